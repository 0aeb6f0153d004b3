//! Which host a process runs on, as far as memory sharing goes.
//!
//! Two legs may READ through shared memory only when one can open the other's memfd through
//! `/proc/<pid>/fd`: the same kernel (boot id), and the same network namespace, which is what
//! separates containers and the "hosts" of a network-namespace test on one machine. The host id
//! travels in the handshake; a reader compares it with its own to choose the shm engine or the
//! network engine.

use std::path::Path;

/// Where Linux states the id of the running kernel's boot.
const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Where Linux names this process's network namespace.
const NET_NAMESPACE_PATH: &str = "/proc/self/ns/net";

/// This process's host id: `<boot id>/<host name>/<network namespace>`. Parts that cannot be
/// read are left empty, which only makes two processes look less alike (never more).
pub fn host_id() -> String {
    let boot = std::fs::read_to_string(BOOT_ID_PATH).unwrap_or_default();
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let namespace = std::fs::read_link(Path::new(NET_NAMESPACE_PATH))
        .map(|link| link.display().to_string())
        .unwrap_or_default();
    format!("{}/{}/{}", boot.trim(), name.trim(), namespace)
}

/// Whether two host ids name one host where shared memory works: equal, and neither unknown.
pub fn same_host(ours: &str, theirs: &str) -> bool {
    let known = |id: &str| id.split('/').all(|part| !part.is_empty());
    ours == theirs && known(ours)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_on_its_own_host_and_unknown_hosts_never_match() {
        let ours = host_id();
        assert!(same_host(&ours, &ours), "{ours}");
        assert!(!same_host(&ours, "other-boot/other/net:[1]"));
        assert!(!same_host("//", "//"));
        assert!(!same_host("boot/name/", "boot/name/"));
    }
}
