//! The machine's own floor: a one-byte TCP ping-pong over loopback. Forwarding adds
//! at least one such round trip (edge → owner → edge), so this is the yardstick the
//! forwarding cost is judged by.
//!
//! Where the two ends run matters more than anything else: on one CPU a round trip
//! is a pair of context switches; across CPUs each direction wakes a sleeping CPU,
//! which on a virtual machine can cost ten times more. Both are measured with the
//! threads pinned, so the figure does not flip with the scheduler's placement. The
//! yardstick is the cross-CPU one: an edge worker and an owner worker are separate
//! busy processes, which the scheduler spreads over the CPUs.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;
use serde::Serialize;

use super::latency::{self, new_histogram};

/// Round trips measured per placement; a tenth more warm the path first.
pub const DEFAULT_ITERATIONS: u32 = 10_000;

/// Round-trip times of a 1-byte TCP ping-pong, in microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct LoopbackRtt {
    pub iterations: u32,
    /// Where the yardstick's two ends ran: "different CPUs", or "unpinned" on a
    /// machine where pinning is not possible.
    pub placement: &'static str,
    /// The yardstick.
    pub p50_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    /// Both ends pinned to one CPU, for comparison.
    pub same_cpu_p50_us: Option<f64>,
    pub same_cpu_p99_us: Option<f64>,
}

/// Round trip figures of one placement.
#[derive(Debug, Clone, Copy)]
struct Figures {
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
}

/// Measures with blocking sockets on two threads: what the kernel costs, without any
/// runtime's scheduling on top.
pub fn measure(iterations: u32) -> std::io::Result<LoopbackRtt> {
    let cpus = allowed_cpus();
    let same = match cpus.first() {
        Some(&cpu) => ping_pong(iterations, Some((cpu, cpu))).ok(),
        None => None,
    };
    let (placement, yardstick) = match cpus.as_slice() {
        [a, b, ..] => ("different CPUs", ping_pong(iterations, Some((*a, *b)))?),
        _ => ("unpinned", ping_pong(iterations, None)?),
    };
    Ok(LoopbackRtt {
        iterations,
        placement,
        p50_us: yardstick.p50_us,
        p99_us: yardstick.p99_us,
        max_us: yardstick.max_us,
        same_cpu_p50_us: same.map(|f| f.p50_us),
        same_cpu_p99_us: same.map(|f| f.p99_us),
    })
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    let Ok(set) = sched_getaffinity(Pid::from_raw(0)) else {
        return Vec::new();
    };
    (0..CpuSet::count())
        .filter(|&cpu| set.is_set(cpu).unwrap_or(false))
        .collect()
}

/// Pins the calling thread to `cpu`; a failure leaves it unpinned.
fn pin(cpu: usize) {
    let mut set = CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = sched_setaffinity(Pid::from_raw(0), &set);
    }
}

/// `pins`: (echo thread CPU, client thread CPU).
fn ping_pong(iterations: u32, pins: Option<(usize, usize)>) -> std::io::Result<Figures> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        if let Some((cpu, _)) = pins {
            pin(cpu);
        }
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
    // The client side runs on a thread of its own too, so pinning it leaves the
    // caller's thread (a runtime's blocking-pool thread) as it was.
    let client = std::thread::spawn(move || -> std::io::Result<Figures> {
        if let Some((_, cpu)) = pins {
            pin(cpu);
        }
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
        Ok(Figures {
            p50_us: histogram.value_at_quantile(0.5) as f64 / 1000.0,
            p99_us: histogram.value_at_quantile(0.99) as f64 / 1000.0,
            max_us: histogram.max() as f64 / 1000.0,
        })
    });
    let figures = client
        .join()
        .map_err(|_| std::io::Error::other("the ping thread panicked"))?;
    // The client's stream is closed by now, so the echo thread sees the end.
    let echoed = echo
        .join()
        .map_err(|_| std::io::Error::other("the echo thread panicked"))?;
    let figures = figures?;
    echoed?;
    Ok(figures)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_round_trip_is_measured() {
        let rtt = measure(200).expect("loopback works");
        assert_eq!(rtt.iterations, 200);
        assert!(rtt.p50_us > 0.0 && rtt.p50_us <= rtt.p99_us && rtt.p99_us <= rtt.max_us);
        if allowed_cpus().len() >= 2 {
            assert_eq!(rtt.placement, "different CPUs");
            assert!(rtt.same_cpu_p50_us.is_some());
        }
    }
}
