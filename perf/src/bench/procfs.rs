//! What the kernel knows about the processes under test: CPU time (utime + stime
//! from `/proc/<pid>/stat`), resident memory (`VmRSS` in `/proc/<pid>/status`), and
//! the process tree, so a supervisor's workers are counted with it. Linux only; on
//! other systems the figures are simply absent.

use std::collections::BTreeSet;
use std::path::Path;

/// Clock ticks per second of the CPU times in `/proc/<pid>/stat`.
///
/// Read once from `getconf CLK_TCK`; 100 (the value on every mainstream Linux
/// architecture) when `getconf` is unavailable.
pub fn clock_ticks_per_second() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .filter(|out| out.status.success())
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse().ok())
        .filter(|ticks| *ticks > 0)
        .unwrap_or(100)
}

/// utime + stime, in clock ticks, from the text of `/proc/<pid>/stat`.
///
/// The command name (field 2) is in parentheses and may hold spaces or `)`, so
/// fields are counted from the last `)`.
pub fn parse_stat_cpu_ticks(stat: &str) -> Option<u64> {
    let fields = parse_stat_fields(stat)?;
    // After the name: state (3), ppid (4) … utime (14), stime (15).
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// The parent pid from the text of `/proc/<pid>/stat`.
pub fn parse_stat_ppid(stat: &str) -> Option<u32> {
    parse_stat_fields(stat)?.get(1)?.parse().ok()
}

fn parse_stat_fields(stat: &str) -> Option<Vec<&str>> {
    let (_, after_name) = stat.rsplit_once(')')?;
    Some(after_name.split_whitespace().collect())
}

/// `VmRSS` in bytes from the text of `/proc/<pid>/status`.
pub fn parse_vm_rss_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut words = line["VmRSS:".len()..].split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    match words.next() {
        Some("kB") | None => Some(value * 1024),
        Some(_) => None,
    }
}

/// Busy clock ticks of the whole machine (all CPUs) from the text of `/proc/stat`:
/// user, nice, system, irq, softirq and steal; idle and iowait are not busy.
pub fn parse_machine_busy_ticks(stat: &str) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy = [0, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|&i| fields.get(i))
        .sum();
    (fields.len() >= 4).then_some(busy)
}

/// Busy ticks of the whole machine so far, to see what else ran during a window.
pub fn machine_busy_ticks() -> Option<u64> {
    parse_machine_busy_ticks(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// Network counters of this machine's network namespace (`/proc/net/snmp`): how
/// many packets a request costs, and whether any were dropped or resent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetCounters {
    pub tcp_in_segments: u64,
    pub tcp_retransmitted: u64,
    pub udp_in_datagrams: u64,
    /// UDP datagrams dropped because a socket's receive buffer was full (QUIC loss).
    pub udp_receive_buffer_drops: u64,
}

/// Reads the counters from the text of `/proc/net/snmp`: each protocol has a line
/// of names followed by a line of values.
pub fn parse_snmp(text: &str) -> Option<NetCounters> {
    let value = |protocol: &str, name: &str| -> Option<u64> {
        let prefix = format!("{protocol}:");
        let mut lines = text.lines().filter(|l| l.starts_with(&prefix));
        let names = lines.next()?.split_whitespace();
        let values = lines.next()?.split_whitespace();
        names
            .zip(values)
            .find(|(n, _)| *n == name)
            .and_then(|(_, v)| v.parse().ok())
    };
    Some(NetCounters {
        tcp_in_segments: value("Tcp", "InSegs")?,
        tcp_retransmitted: value("Tcp", "RetransSegs")?,
        udp_in_datagrams: value("Udp", "InDatagrams")?,
        udp_receive_buffer_drops: value("Udp", "RcvbufErrors")?,
    })
}

pub fn net_counters() -> Option<NetCounters> {
    parse_snmp(&std::fs::read_to_string("/proc/net/snmp").ok()?)
}

/// CPU ticks consumed so far by `pid` (0 when it is gone).
pub fn cpu_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| parse_stat_cpu_ticks(&stat))
        .unwrap_or(0)
}

/// Resident memory of `pid` in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| parse_vm_rss_bytes(&status))
}

/// The worker process of a `mcpgw serve --workers 1` supervisor: its only descendant
/// (the public port tells who answers, not its pid). None while there is not exactly
/// one, for example while a replaced worker is being reaped.
pub fn sole_worker(supervisor: u32) -> Option<u32> {
    let mut below = with_descendants(&[supervisor]);
    below.remove(&supervisor);
    match below.len() {
        1 => below.pop_first(),
        _ => None,
    }
}

/// `roots` and every process below them, as they are now.
pub fn with_descendants(roots: &[u32]) -> BTreeSet<u32> {
    let mut found: BTreeSet<u32> = BTreeSet::new();
    let mut queue: Vec<u32> = roots.to_vec();
    let mut parents: Option<Vec<(u32, u32)>> = None;
    while let Some(pid) = queue.pop() {
        if !found.insert(pid) {
            continue;
        }
        match children_of(pid) {
            Some(children) => queue.extend(children),
            None => {
                // Kernels without CONFIG_PROC_CHILDREN: scan every process's parent once.
                let table = parents.get_or_insert_with(parent_table);
                queue.extend(
                    table
                        .iter()
                        .filter(|(_, ppid)| *ppid == pid)
                        .map(|(child, _)| *child),
                );
            }
        }
    }
    found
}

/// Children from `/proc/<pid>/task/*/children`; None when the kernel lacks the file.
fn children_of(pid: u32) -> Option<Vec<u32>> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut children = Vec::new();
    let mut any = false;
    for task in tasks.flatten() {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            any = true;
            children.extend(parse_pid_list(&text));
        }
    }
    any.then_some(children)
}

fn parent_table() -> Vec<(u32, u32)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat =
                std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("stat"))
                    .ok()?;
            Some((pid, parse_stat_ppid(&stat)?))
        })
        .collect()
}

/// The space-separated pids of a `children` file.
pub fn parse_pid_list(text: &str) -> impl Iterator<Item = u32> + '_ {
    text.split_whitespace().filter_map(|p| p.parse().ok())
}

/// Total CPU ticks of `roots` and their descendants, now.
pub fn tree_cpu_ticks(roots: &[u32]) -> u64 {
    with_descendants(roots).into_iter().map(cpu_ticks).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STAT: &str = "4242 (mcpgw worker) S 4200 4200 4100 0 -1 4194560 1200 0 0 0 \
                        731 269 0 0 20 0 6 0 123456 1000000 2000 18446744073709551615";

    #[test]
    fn stat_yields_utime_plus_stime_and_the_parent() {
        assert_eq!(parse_stat_cpu_ticks(STAT), Some(1000));
        assert_eq!(parse_stat_ppid(STAT), Some(4200));
    }

    #[test]
    fn a_process_name_with_parentheses_does_not_shift_fields() {
        let tricky = STAT.replace("(mcpgw worker)", "(a) b (c))");
        assert_eq!(parse_stat_cpu_ticks(&tricky), Some(1000));
        assert_eq!(parse_stat_cpu_ticks("garbage"), None);
    }

    #[test]
    fn vm_rss_is_read_in_bytes() {
        let status = "Name:\tmcpgw\nVmPeak:\t  9000 kB\nVmRSS:\t   12345 kB\nThreads:\t4\n";
        assert_eq!(parse_vm_rss_bytes(status), Some(12345 * 1024));
        assert_eq!(parse_vm_rss_bytes("Name:\tx\n"), None);
    }

    #[test]
    fn machine_busy_time_leaves_out_idle_and_iowait() {
        let stat = "cpu  100 5 50 9000 40 3 2 1 0 0\ncpu0 50 2 25 4500 20 1 1 0 0 0\nintr 1\n";
        assert_eq!(
            parse_machine_busy_ticks(stat),
            Some(100 + 5 + 50 + 3 + 2 + 1)
        );
        assert_eq!(parse_machine_busy_ticks("intr 1\n"), None);
    }

    #[test]
    fn snmp_counters_are_found_by_name() {
        let snmp = "Tcp: RtoAlgorithm InSegs OutSegs RetransSegs\nTcp: 1 2000 1990 7\n\
                    Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors\n\
                    Udp: 500 0 3 499 3\n";
        assert_eq!(
            parse_snmp(snmp),
            Some(NetCounters {
                tcp_in_segments: 2000,
                tcp_retransmitted: 7,
                udp_in_datagrams: 500,
                udp_receive_buffer_drops: 3,
            })
        );
        assert_eq!(parse_snmp("Tcp: InSegs\n"), None);
    }

    #[test]
    fn children_files_list_pids() {
        assert_eq!(parse_pid_list("12 34 \n").collect::<Vec<_>>(), vec![12, 34]);
    }

    #[test]
    fn this_process_is_found_and_uses_cpu() {
        let me = std::process::id();
        assert!(with_descendants(&[me]).contains(&me));
        assert!(rss_bytes(me).is_some_and(|rss| rss > 0));
        // Burn a little CPU so the counter has something to show.
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(tree_cpu_ticks(&[me]) > 0);
    }
}
