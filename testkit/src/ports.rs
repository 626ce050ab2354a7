//! Ports for a process that is told its port as an argument and binds it later (an
//! etcd, a pod of the test kubelet), perhaps more than once (a restarted member or pod
//! keeps its port).
//!
//! Binding `127.0.0.1:0` and releasing the port is not enough for such a process: that
//! port comes from the kernel's ephemeral range, which is also where every outgoing
//! connection on the host takes its source port, so between the release and a (re)bind
//! any client connection may hold it, and a restarted pod then fails to bind for as long
//! as that connection lives (a trainer pod crash-looped so in a CI run). [`free_port`]
//! picks below the ephemeral range, where the kernel never hands a port out by itself,
//! at random (test processes run side by side) and only a port that binds now.

use std::collections::BTreeSet;
use std::hash::{BuildHasher, RandomState};
use std::net::TcpListener;
use std::sync::Mutex;

/// The lowest port this picks from.
const LOWEST: u16 = 10_000;

/// Ports this process has handed out (never twice).
static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// The kernel's ephemeral range's first port (`ip_local_port_range`; Linux's default
/// when it cannot be read).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A loopback port free now, outside the ephemeral range, not handed out before by
/// this process; an ephemeral one (bound to port 0) if no such port binds after 1,000
/// tries.
pub fn free_port() -> u16 {
    let high = ephemeral_low();
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    if high > LOWEST + 1_000 {
        let seed = RandomState::new();
        let span = u64::from(high - LOWEST);
        for i in 0..1_000u64 {
            let port = LOWEST + u16::try_from(seed.hash_one(i) % span).unwrap_or(0);
            if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.insert(port);
                return port;
            }
        }
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port();
    given.insert(port);
    port
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_below_the_ephemeral_range_distinct_and_bindable() {
        let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
        let distinct: BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
        for p in &ports {
            assert!((LOWEST..ephemeral_low()).contains(p), "{p}");
        }
        // A port held by a listener is not handed out.
        let held: Vec<TcpListener> = ports
            .iter()
            .map(|p| TcpListener::bind(("127.0.0.1", *p)).expect("bindable"))
            .collect();
        let next = free_port();
        assert!(!ports.contains(&next));
        drop(held);
    }
}
