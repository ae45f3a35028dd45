//! The machine's own floor: a one-byte TCP ping-pong over loopback. Forwarding adds
//! at least one such round trip, so this is the yardstick the forwarding cost is
//! judged by.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use serde::Serialize;

use super::latency::{self, new_histogram};

/// Round trips measured; the first tenth more warm the path first.
pub const DEFAULT_ITERATIONS: u32 = 10_000;

/// Round-trip time of a 1-byte TCP ping-pong, in microseconds (fractional: the
/// histogram records nanoseconds).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LoopbackRtt {
    pub iterations: u32,
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
}

/// Measures with blocking sockets on two threads: what the kernel costs, without any
/// runtime's scheduling on top.
pub fn measure(iterations: u32) -> std::io::Result<LoopbackRtt> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut stream, _) = listener.accept()?;
        stream.set_nodelay(true)?;
        let mut byte = [0u8; 1];
        loop {
            match stream.read(&mut byte)? {
                0 => return Ok(()),
                _ => stream.write_all(&byte)?,
            }
        }
    });
    let mut stream = TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let mut histogram = new_histogram();
    let mut byte = [7u8; 1];
    let warmup = iterations / 10;
    for i in 0..warmup + iterations {
        let sent = Instant::now();
        stream.write_all(&byte)?;
        stream.read_exact(&mut byte)?;
        let nanos = u64::try_from(sent.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if i >= warmup {
            latency::record(&mut histogram, nanos);
        }
    }
    drop(stream);
    echo.join()
        .map_err(|_| std::io::Error::other("the echo thread panicked"))??;
    Ok(LoopbackRtt {
        iterations,
        p50_us: histogram.value_at_quantile(0.5) as f64 / 1000.0,
        p99_us: histogram.value_at_quantile(0.99) as f64 / 1000.0,
        max_us: histogram.max() as f64 / 1000.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_round_trip_is_measured() {
        let rtt = measure(200).expect("loopback works");
        assert_eq!(rtt.iterations, 200);
        assert!(rtt.p50_us > 0.0 && rtt.p50_us <= rtt.p99_us && rtt.p99_us <= rtt.max_us);
    }
}
