//! Process metrics in Prometheus's standard names, read from `/proc/self` (Linux, where the
//! container runs; elsewhere nothing is exported): resident memory against the pod's limit,
//! CPU time, open file descriptors against their limit, start time.

/// User-space clock ticks per second in `/proc/*/stat` (USER_HZ: 100 on every Linux ABI).
const TICKS_PER_SECOND: f64 = 100.0;

/// What one reading of `/proc/self` found.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reading {
    pub resident_bytes: Option<f64>,
    pub cpu_seconds: Option<f64>,
    pub open_fds: Option<f64>,
    pub max_fds: Option<f64>,
    pub start_time_seconds: Option<f64>,
}

/// CPU seconds (utime + stime) and start time after boot (seconds) from `/proc/self/stat`.
/// The command name may hold spaces and parentheses, so fields are counted after its last `)`.
pub fn parse_stat(stat: &str) -> Option<(f64, f64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state is field 3 of the file, so field n is at index n - 3.
    let utime: f64 = fields.get(14 - 3)?.parse().ok()?;
    let stime: f64 = fields.get(15 - 3)?.parse().ok()?;
    let start: f64 = fields.get(22 - 3)?.parse().ok()?;
    Some(((utime + stime) / TICKS_PER_SECOND, start / TICKS_PER_SECOND))
}

/// Resident pages (second field of `/proc/self/statm`).
pub fn parse_statm(statm: &str) -> Option<f64> {
    statm.split_whitespace().nth(1)?.parse().ok()
}

/// The soft limit of "Max open files" in `/proc/self/limits`.
pub fn parse_max_fds(limits: &str) -> Option<f64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..].split_whitespace().next()?.parse().ok()
}

/// Seconds since the epoch at boot (`btime` in `/proc/stat`).
pub fn parse_boot_time(stat: &str) -> Option<f64> {
    stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()
}

/// Reads `/proc/self` now.
pub fn read() -> Reading {
    let text = |p: &str| std::fs::read_to_string(p).ok();
    let stat = text("/proc/self/stat").as_deref().and_then(parse_stat);
    let boot = text("/proc/stat").as_deref().and_then(parse_boot_time);
    Reading {
        // The page size is 4 KiB on the x86_64 and arm64 Linux the image is built for.
        resident_bytes: text("/proc/self/statm").as_deref().and_then(parse_statm).map(|pages| pages * 4096.0),
        cpu_seconds: stat.map(|(cpu, _)| cpu),
        open_fds: std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as f64),
        max_fds: text("/proc/self/limits").as_deref().and_then(parse_max_fds),
        start_time_seconds: stat.zip(boot).map(|((_, after_boot), boot)| boot + after_boot),
    }
}

pub const RESIDENT_MEMORY: &str = "process_resident_memory_bytes";
pub const OPEN_FDS: &str = "process_open_fds";
pub const MAX_FDS: &str = "process_max_fds";
pub const START_TIME: &str = "process_start_time_seconds";
pub const CPU_SECONDS: &str = "process_cpu_seconds_total";

/// Help texts, once at start-up.
pub fn describe() {
    metrics::describe_gauge!(RESIDENT_MEMORY, metrics::Unit::Bytes, "Resident memory size in bytes.");
    metrics::describe_gauge!(OPEN_FDS, "Open file descriptors.");
    metrics::describe_gauge!(MAX_FDS, "The soft limit on open file descriptors.");
    metrics::describe_gauge!(START_TIME, metrics::Unit::Seconds, "When the process started, seconds since the epoch.");
    metrics::describe_counter!(CPU_SECONDS, metrics::Unit::Seconds, "User and system CPU time spent, in whole seconds.");
}

/// Sets the gauges from a reading (the exporter's upkeep calls it every few seconds).
pub fn export(r: &Reading) {
    let set = |name: &'static str, v: Option<f64>| {
        if let Some(v) = v {
            metrics::gauge!(name).set(v);
        }
    };
    set(RESIDENT_MEMORY, r.resident_bytes);
    set(OPEN_FDS, r.open_fds);
    set(MAX_FDS, r.max_fds);
    set(START_TIME, r.start_time_seconds);
    // The recorder's counters hold whole numbers: CPU time in whole seconds.
    if let Some(cpu) = r.cpu_seconds {
        metrics::counter!(CPU_SECONDS).absolute(cpu as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_files_parse() {
        let stat = "4567 (odd) name) R 4564 4564 1109 0 -1 4194304 125 0 0 0 250 50 0 0 20 0 1 0 317739 3133440 394 18446744073709551615";
        assert_eq!(parse_stat(stat), Some((3.0, 3177.39)));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_statm("765 418 390 5 0 123 0"), Some(418.0));
        let limits = "Limit                     Soft Limit           Hard Limit           Units\nMax open files            1048576              1048576              files\n";
        assert_eq!(parse_max_fds(limits), Some(1_048_576.0));
        assert_eq!(parse_boot_time("cpu  1 2 3\nbtime 1764460800\nprocesses 5\n"), Some(1_764_460_800.0));
    }

    #[test]
    fn this_process_reads_itself() {
        let r = read();
        if cfg!(target_os = "linux") {
            assert!(r.resident_bytes.is_some_and(|b| b > 1_000_000.0), "{r:?}");
            assert!(r.open_fds.is_some_and(|n| n >= 3.0), "{r:?}");
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
            assert!(r.start_time_seconds.is_some_and(|t| t <= now + 1.0 && t > now - 86_400.0 * 365.0), "{r:?}");
        }
    }
}
