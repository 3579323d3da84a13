//! Who is on the other end of a client connection, found without asking the peer.
//!
//! A Mooncake client names itself (its `client_id`) only in the calls of the put family
//! and the segment lifecycle. A requester-only rank (`global_segment_size = 0`, vLLM's
//! owner-client topology) mostly looks keys up, and lookups carry no client id; and one
//! client spreads its calls over a pool of connections (two in every capture). So a
//! connection is identified by the process behind it: on loopback, the kernel knows
//! which process owns the other socket (`/proc/net/tcp{,6}` gives the socket's inode,
//! `/proc/PID/fd` the process holding it; `/proc/PID/stat` its start time, so a reused
//! pid is another peer). From another host only the address is known.
//!
//! Linux only, read-only, off the async runtime (the caller runs it on a blocking
//! thread); bounded by the number of processes and descriptors on the host. Anything
//! that cannot be read (another user's process without privileges, another pid
//! namespace, a non-Linux host) gives [`PeerKey::Addr`].

use std::net::{IpAddr, SocketAddr};

/// The identity of a client connection's peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PeerKey {
    /// A local process: pid and its start time in clock ticks since boot.
    Process { pid: u32, start: u64 },
    /// A remote peer (or a local one that could not be resolved): its address only.
    Addr(IpAddr),
}

impl std::fmt::Display for PeerKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PeerKey::Process { pid, .. } => write!(f, "pid:{pid}"),
            PeerKey::Addr(ip) => write!(f, "addr:{ip}"),
        }
    }
}

/// The peer of the connection whose two ends are `ours` (the address moongate accepted
/// on) and `theirs` (the peer's address). `known_pids` are searched first: a client's
/// second pooled connection belongs, almost always, to a process already seen.
pub fn identify(ours: SocketAddr, theirs: SocketAddr, known_pids: &[u32]) -> PeerKey {
    if !theirs.ip().is_loopback() && theirs.ip() != ours.ip() {
        return PeerKey::Addr(theirs.ip());
    }
    let Some(inode) = socket_inode(ours, theirs) else {
        return PeerKey::Addr(theirs.ip());
    };
    let own = std::process::id();
    let pid = known_pids
        .iter()
        .copied()
        .filter(|&p| p != own)
        .find(|&p| holds(p, inode))
        .or_else(|| all_pids().filter(|&p| p != own).find(|&p| holds(p, inode)));
    match pid.and_then(|pid| start_time(pid).map(|start| (pid, start))) {
        Some((pid, start)) => PeerKey::Process { pid, start },
        None => PeerKey::Addr(theirs.ip()),
    }
}

/// The inode of the peer's socket: the one whose local end is `theirs` and remote end
/// `ours`.
fn socket_inode(ours: SocketAddr, theirs: SocketAddr) -> Option<u64> {
    let file = if theirs.is_ipv4() {
        "/proc/net/tcp"
    } else {
        "/proc/net/tcp6"
    };
    let text = std::fs::read_to_string(file).ok()?;
    find_inode(&text, ours, theirs)
}

/// Parses a `/proc/net/tcp{,6}` table for the socket local = `theirs`, remote = `ours`.
pub fn find_inode(table: &str, ours: SocketAddr, theirs: SocketAddr) -> Option<u64> {
    table.lines().skip(1).find_map(|line| {
        let mut f = line.split_whitespace();
        let local = parse_addr(f.nth(1)?)?;
        let remote = parse_addr(f.next()?)?;
        if local != theirs || remote != ours {
            return None;
        }
        // st, tx:rx, tr:when, retrnsmt, uid, timeout, then the inode.
        f.nth(6)?.parse().ok().filter(|&i| i != 0)
    })
}

/// `0100007F:1F90` (IPv4) or 32 hex digits then `:PORT` (IPv6), as the kernel prints
/// them: each 32-bit word of the address in the host's byte order.
fn parse_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match ip.len() {
        8 => IpAddr::from(u32::from_str_radix(ip, 16).ok()?.to_ne_bytes()),
        32 => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_mut(4).enumerate() {
                let word = u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16).ok()?;
                chunk.copy_from_slice(&word.to_ne_bytes());
            }
            let v6 = std::net::Ipv6Addr::from(b);
            // A v4 peer on a dual-stack listener shows as ::ffff:a.b.c.d.
            v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

fn all_pids() -> impl Iterator<Item = u32> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
}

/// Whether process `pid` holds the socket `inode`.
fn holds(pid: u32, inode: u64) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let want = format!("socket:[{inode}]");
    dir.flatten().any(|fd| {
        std::fs::read_link(fd.path())
            .ok()
            .is_some_and(|t| t.as_os_str() == want.as_str())
    })
}

/// Field 22 of `/proc/PID/stat`: the start time in clock ticks since boot.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: skip past its end.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The Mooncake release a local process runs, from the wheel its store module was
/// loaded from: `/proc/PID/maps` names the module's file (a `.so` under a `mooncake/`
/// package directory), and the `mooncake_transfer_engine*.dist-info/METADATA` beside
/// that package says the version. `None` for anything else (a client not installed
/// from a wheel, a C++ engine, a process that cannot be read): its calls tell it then,
/// or `master_face.client_release`. Lookups have one layout in 0.3.12 and 0.3.13 while
/// their answers differ, so a reader that never writes is known only this way.
pub fn mooncake_release(pid: u32) -> Option<crate::codec::release::MasterRelease> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    let site = site_packages_in_maps(&maps)?;
    let dir = std::fs::read_dir(site).ok()?;
    for e in dir.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("mooncake_transfer_engine") && name.ends_with(".dist-info") {
            let meta = std::fs::read_to_string(e.path().join("METADATA")).ok()?;
            return release_of_metadata(&meta);
        }
    }
    None
}

/// The directory holding the `mooncake` package whose module a maps table shows loaded.
pub fn site_packages_in_maps(maps: &str) -> Option<&str> {
    maps.lines().find_map(|line| {
        let path = line.split_whitespace().nth(5)?;
        let (site, file) = path.rsplit_once("/mooncake/")?;
        (file.ends_with(".so") && !file.contains('/')).then_some(site)
    })
}

/// The release a wheel's `METADATA` names (`Version: 0.3.12.post1` is 0.3.12).
pub fn release_of_metadata(meta: &str) -> Option<crate::codec::release::MasterRelease> {
    use crate::codec::release::MasterRelease;
    let v = meta
        .lines()
        .find_map(|l| l.strip_prefix("Version:"))?
        .trim();
    MasterRelease::ALL.into_iter().find(|r| {
        v.strip_prefix(r.label())
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_peer_socket_in_a_kernel_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:C350 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0\n\
   1: 0100007F:9C40 0100007F:C350 01 00000000:00000000 00:00000000 00000000     0        0 222 1 0 20 4 30 10 -1\n\
   2: 0100007F:C350 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0 20 4 30 10 -1\n";
        let ours: SocketAddr = "127.0.0.1:50000".parse().unwrap();
        let theirs: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        assert_eq!(find_inode(table, ours, theirs), Some(222));
        assert_eq!(find_inode(table, theirs, ours), Some(333));
        assert_eq!(find_inode("", ours, theirs), None);
        assert_eq!(
            find_inode("header\ngarbage line\n  3: zz:zz", ours, theirs),
            None
        );
    }

    #[test]
    fn ipv6_and_mapped_addresses() {
        assert_eq!(
            parse_addr("00000000000000000000000001000000:1F90"),
            Some("[::1]:8080".parse().unwrap())
        );
        assert_eq!(
            parse_addr("0000000000000000FFFF00000100007F:1F90"),
            Some("127.0.0.1:8080".parse().unwrap())
        );
        assert_eq!(parse_addr("0100007F"), None);
        assert_eq!(parse_addr("12:zz"), None);
    }

    #[test]
    fn a_live_loopback_connection_names_this_process_and_a_remote_address_does_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(ours).unwrap();
        let theirs = client.local_addr().unwrap();
        // Both ends are in this process: it skips itself, so the socket is found and no
        // other process holds it.
        assert_eq!(identify(ours, theirs, &[]), PeerKey::Addr(theirs.ip()));
        assert!(socket_inode(ours, theirs).is_some());
        assert!(holds(
            std::process::id(),
            socket_inode(ours, theirs).unwrap()
        ));
        assert!(start_time(std::process::id()).is_some());
        let remote: SocketAddr = "10.1.2.3:999".parse().unwrap();
        assert_eq!(
            identify(ours, remote, &[]),
            PeerKey::Addr("10.1.2.3".parse().unwrap())
        );
    }

    #[test]
    fn a_process_s_mooncake_release_is_read_from_its_wheel() {
        use crate::codec::release::MasterRelease;
        let maps = "\
7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000002000-7f0000003000 r-xp 00000000 08:01 2 /v/lib/python3.11/site-packages/mooncake/store.cpython-311-x86_64-linux-gnu.so
7f0000004000-7f0000005000 rw-p 00000000 00:00 0
";
        assert_eq!(
            site_packages_in_maps(maps),
            Some("/v/lib/python3.11/site-packages")
        );
        // A `.so` in a subdirectory of the package, or no package at all: not it.
        assert_eq!(
            site_packages_in_maps(
                "1-2 r-xp 0 0:0 1 /x/mooncake/sub/a.so\n1-2 r-xp 0 0:0 1 /x/y.so\n"
            ),
            None
        );
        let meta = |v: &str| format!("Metadata-Version: 2.1\nName: x\nVersion: {v}\n");
        assert_eq!(
            release_of_metadata(&meta("0.3.12.post1")),
            Some(MasterRelease::V0_3_12)
        );
        assert_eq!(
            release_of_metadata(&meta("0.3.14")),
            Some(MasterRelease::V0_3_14)
        );
        assert_eq!(
            release_of_metadata(&meta("0.3.11.post1")),
            Some(MasterRelease::V0_3_11)
        );
        assert_eq!(release_of_metadata(&meta("0.3.130")), None);
        assert_eq!(release_of_metadata(&meta("0.4.0")), None);
        assert_eq!(release_of_metadata("Name: x\n"), None);
    }
}
