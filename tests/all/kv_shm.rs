//! The kv face's shared-memory path (`kv/api/shm.rs`) against bad peers, spoken raw over
//! the Unix socket beside a real master: every malformed or unsafe request gets its
//! error, registrations are bounded and released with their connection, a peer of
//! another uid is refused, and HTTP on the same socket keeps serving throughout.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::support::*;

const MAGIC: &[u8; 8] = b"MGSHM01\n";

/// A raw shared-memory connection.
pub(crate) struct Raw {
    s: UnixStream,
    seq: u32,
}

impl Raw {
    pub(crate) fn open(path: &Path) -> Raw {
        let mut s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(MAGIC).unwrap();
        let mut back = [0u8; 8];
        s.read_exact(&mut back).unwrap();
        assert_eq!(&back, MAGIC);
        Raw { s, seq: 0 }
    }

    /// Sends one frame (with `fd` attached) and reads its answer: (status, body).
    pub(crate) fn call(&mut self, op: u8, body: &[u8], fd: Option<RawFd>) -> (i32, Vec<u8>) {
        self.seq += 1;
        let mut f = Vec::new();
        f.extend_from_slice(&(body.len() as u32).to_le_bytes());
        f.extend_from_slice(&self.seq.to_le_bytes());
        f.push(op);
        f.extend_from_slice(body);
        match fd {
            Some(fd) => send_with_fd(&self.s, &f, fd),
            None => self.s.write_all(&f).unwrap(),
        }
        let (seq, status, body) = self.answer().expect("an answer");
        assert_eq!(seq, self.seq);
        (status, body)
    }

    fn answer(&mut self) -> Option<(u32, i32, Vec<u8>)> {
        let mut h = [0u8; 12];
        self.s.read_exact(&mut h).ok()?;
        let len = u32::from_le_bytes(h[0..4].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        self.s.read_exact(&mut body).ok()?;
        Some((
            u32::from_le_bytes(h[4..8].try_into().unwrap()),
            i32::from_le_bytes(h[8..12].try_into().unwrap()),
            body,
        ))
    }

    fn register(&mut self, len: u64, fd: RawFd) -> (i32, Vec<u8>) {
        self.call(1, &len.to_le_bytes(), Some(fd))
    }

    fn get_into(&mut self, region: u32, off: u64, cap: u64, key: &str) -> (i32, Vec<u8>) {
        let mut b = region.to_le_bytes().to_vec();
        b.extend_from_slice(&off.to_le_bytes());
        b.extend_from_slice(&cap.to_le_bytes());
        b.extend_from_slice(key.as_bytes());
        self.call(3, &b, None)
    }
}

fn send_with_fd(s: &UnixStream, data: &[u8], fd: RawFd) {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    let mut control = [0u64; 4];
    // SAFETY: test code: a msghdr over our own buffers with one SCM_RIGHTS fd.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(4) as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(4) as _;
        libc::CMSG_DATA(c).cast::<RawFd>().write_unaligned(fd);
        assert_eq!(libc::sendmsg(s.as_raw_fd(), &msg, 0), data.len() as isize);
    }
}

/// A memfd of `len` bytes, sealed against shrinking when `sealed`.
pub(crate) fn memfd(len: u64, sealed: bool) -> OwnedFd {
    // SAFETY: test code: plain syscalls on a new fd.
    unsafe {
        let fd = libc::memfd_create(c"t".as_ptr(), libc::MFD_ALLOW_SEALING);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, len as i64), 0);
        if sealed {
            assert_eq!(libc::fcntl(fd, libc::F_ADD_SEALS, libc::F_SEAL_SHRINK), 0);
        }
        OwnedFd::from_raw_fd(fd)
    }
}

fn message(body: &[u8]) -> String {
    String::from_utf8_lossy(body).into_owned()
}

fn registered(mg: &Moongate) -> f64 {
    metric_value(&mg.metrics(), "moongate_kv_shm_registered_bytes")
}

#[test]
fn bad_shared_memory_requests_get_errors_and_registrations_stay_bounded() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, kv, sock) = kv_unix_moongate(
        &master,
        dir.path(),
        16777216,
        "shm_max_regions = 4\n\
             shm_max_bytes_per_connection = 8388608\nshm_max_bytes = 12582912\n",
    );
    let value = value_of("shm/v", 100_000);
    let mut http = moongate_kv::Client::connect_unix(&sock).unwrap();
    http.put("shm/v", &value).unwrap();
    let served = |http: &mut moongate_kv::Client| {
        assert_eq!(http.get("shm/v").unwrap().as_deref(), Some(&value[..]));
    };

    let mut a = Raw::open(&sock);
    // No descriptor, an unsealed one, one shorter than registered.
    let (st, b) = a.call(1, &4096u64.to_le_bytes(), None);
    assert_eq!(st, -1, "{}", message(&b));
    assert!(
        message(&b).contains("without a file descriptor"),
        "{}",
        message(&b)
    );
    let loose = memfd(1 << 20, false);
    let (st, b) = a.register(1 << 20, loose.as_raw_fd());
    assert!(
        st == -1 && message(&b).contains("F_SEAL_SHRINK"),
        "{}",
        message(&b)
    );
    let short = memfd(4096, true);
    let (st, b) = a.register(1 << 20, short.as_raw_fd());
    assert!(
        st == -1 && message(&b).contains("fewer than"),
        "{}",
        message(&b)
    );
    assert_eq!(registered(&mg), 0.0);

    // A good registration, and reads inside and outside it.
    let fd = memfd(1 << 20, true);
    let (st, b) = a.register(1 << 20, fd.as_raw_fd());
    assert_eq!(st, 0, "{}", message(&b));
    let region = u32::from_le_bytes(b[..4].try_into().unwrap());
    assert_eq!(registered(&mg), (1 << 20) as f64);
    // The seal holds: the peer cannot shrink it under moongate.
    // SAFETY: test code.
    assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
    let (st, b) = a.get_into(region, 4096, 200_000, "shm/v");
    assert_eq!(st, 0, "{}", message(&b));
    assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), 100_000);
    // SAFETY: test code: map the same memfd to look at what moongate wrote.
    let seen = unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            1 << 20,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let v = std::slice::from_raw_parts(p.cast::<u8>().add(4096), 100_000).to_vec();
        libc::munmap(p, 1 << 20);
        v
    };
    assert!(
        seen == value,
        "the bytes moongate read into the memfd differ"
    );
    for (off, cap) in [(1 << 20, 1), ((1 << 20) - 10, 11), (u64::MAX - 5, 10)] {
        let (st, b) = a.get_into(region, off, cap, "shm/v");
        assert!(
            st == -1 && message(&b).contains("outside"),
            "{off}: {}",
            message(&b)
        );
    }
    let (st, b) = a.get_into(region, 0, 10, "shm/v");
    assert!(
        st == -3 && message(&b).contains("100000"),
        "{}",
        message(&b)
    );
    let (st, _) = a.get_into(region, 0, 1 << 20, "shm/absent");
    assert_eq!(st, -2);
    let (st, b) = a.get_into(9, 0, 10, "shm/v");
    assert!(
        st == -1 && message(&b).contains("no registration"),
        "{}",
        message(&b)
    );
    let (st, b) = a.get_into(region, 0, 10, "");
    assert!(st == -1 && message(&b).contains("key"), "{}", message(&b));
    // Overlapping ranges in one batch.
    let mut batch = region.to_le_bytes().to_vec();
    batch.extend_from_slice(&2u32.to_le_bytes());
    for off in [0u64, 50] {
        batch.extend_from_slice(&off.to_le_bytes());
        batch.extend_from_slice(&100u64.to_le_bytes());
        batch.extend_from_slice(&5u16.to_le_bytes());
        batch.extend_from_slice(b"shm/v");
    }
    let (st, b) = a.call(5, &batch, None);
    assert!(
        st == -1 && message(&b).contains("overlap"),
        "{}",
        message(&b)
    );
    // Batch put from the registration (op 6): a range outside it, an empty value, bytes
    // after the last item: the whole call is refused and nothing is stored.
    let items = |list: &[(u64, u64, &str)]| {
        let mut b = region.to_le_bytes().to_vec();
        b.extend_from_slice(&(list.len() as u32).to_le_bytes());
        for (off, len, key) in list {
            b.extend_from_slice(&off.to_le_bytes());
            b.extend_from_slice(&len.to_le_bytes());
            b.extend_from_slice(&(key.len() as u16).to_le_bytes());
            b.extend_from_slice(key.as_bytes());
        }
        b
    };
    for (bad, why) in [
        (
            items(&[(0, 10, "shm/bp/a"), (1 << 20, 1, "shm/bp/b")]),
            "outside",
        ),
        (items(&[(0, 10, "shm/bp/a"), (0, 0, "shm/bp/b")]), "0 bytes"),
        (
            [items(&[(0, 10, "shm/bp/a")]), b"x".to_vec()].concat(),
            "after the last item",
        ),
    ] {
        let (st, b) = a.call(6, &bad, None);
        assert!(
            st == -1 && message(&b).contains(why),
            "{why}: {}",
            message(&b)
        );
    }
    assert_eq!(
        http.get("shm/bp/a").unwrap(),
        None,
        "a refused batch stored a value"
    );
    // A good one: two values read from the memfd (overlapping ranges may share bytes),
    // and a key already stored, refused as over HTTP (-11).
    let (st, b) = a.call(
        6,
        &items(&[
            (4096, 100_000, "shm/bp/a"),
            (4096 + 50_000, 50_000, "shm/bp/b"),
            (0, 10, "shm/v"),
        ]),
        None,
    );
    assert_eq!(st, 0, "{}", message(&b));
    let codes: Vec<i32> = b
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(codes, [0, 0, -11]);
    assert_eq!(http.get("shm/bp/a").unwrap().as_deref(), Some(&value[..]));
    assert_eq!(
        http.get("shm/bp/b").unwrap().as_deref(),
        Some(&value[50_000..])
    );
    // An unknown op, a short body: errors, and the connection goes on.
    let (st, _) = a.call(77, b"", None);
    assert_eq!(st, -1);
    let (st, _) = a.call(3, b"\x01", None);
    assert_eq!(st, -1);
    served(&mut http);

    // Bounds: regions per connection, bytes per connection, bytes in all.
    let more: Vec<OwnedFd> = (0..4).map(|_| memfd(1 << 20, true)).collect();
    let codes: Vec<i32> = more
        .iter()
        .map(|f| a.register(1 << 20, f.as_raw_fd()).0)
        .collect();
    assert_eq!(codes, [0, 0, 0, -9], "4 regions per connection");
    let big = memfd(8 << 20, true);
    let (st, b) = a.register(8 << 20, big.as_raw_fd());
    assert!(st == -9, "{}", message(&b));
    let mut c2 = Raw::open(&sock);
    let (st, _) = c2.register(8 << 20, big.as_raw_fd());
    assert_eq!(st, 0, "8 MiB on a second connection: 12 MiB in all");
    let (st, b) = c2.register(1 << 20, more[3].as_raw_fd());
    assert!(
        st == -9 && message(&b).contains("kv.shm_max_bytes"),
        "{}",
        message(&b)
    );
    assert_eq!(registered(&mg), (12 << 20) as f64);
    served(&mut http);

    // A frame announcing 4 GiB: refused and the connection closed.
    let mut f = u32::MAX.to_le_bytes().to_vec();
    f.extend_from_slice(&99u32.to_le_bytes());
    f.push(3);
    c2.s.write_all(&f).unwrap();
    let (_, st, _) = c2.answer().unwrap();
    assert_eq!(st, -1);
    assert!(c2.answer().is_none(), "closed after a broken frame");
    // A peer that dies with a read under way: moongate finishes into the mapping it
    // holds, cannot answer, and ends the connection.
    let mut c3 = Raw::open(&sock);
    let fd3 = memfd(1 << 20, true);
    // (c3 may be refused the bytes while `a` holds its 5 MiB: then it dies registered
    // or not, and the point stands.)
    let _ = c3.register(1 << 20, fd3.as_raw_fd());
    let mut get = 0u32.to_le_bytes().to_vec();
    get.extend_from_slice(&0u64.to_le_bytes());
    get.extend_from_slice(&(1u64 << 20).to_le_bytes());
    get.extend_from_slice(b"shm/v");
    let mut f = (get.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&7u32.to_le_bytes());
    f.push(3);
    f.extend_from_slice(&get);
    c3.s.write_all(&f).unwrap();
    drop(c3);
    // Connections that end (that one, the broken one, a dropped one) give their bytes
    // back.
    drop(a);
    wait_for(
        "registrations released",
        Duration::from_secs(10),
        &[&mg.proc],
        || registered(&mg) == 0.0,
    );
    served(&mut http);
    let (st, _) = moongate_kv::Client::connect_tcp(&kv)
        .and_then(|mut c| c.get("shm/v").map(|v| (v.map_or(0, |v| v.len()), ())))
        .unwrap();
    assert_eq!(st, value.len(), "TCP serves too");
}

#[test]
fn a_peer_of_another_uid_is_refused_and_http_still_serves() {
    let master = Master::start();
    let dir = tempdir();
    let (mg, _kv, sock) =
        kv_unix_moongate(&master, dir.path(), 16777216, "shm_allowed_uids = [4242]\n");
    match moongate_kv::shm::ShmConn::connect(sock.to_str().unwrap()) {
        Err(moongate_kv::shm::ShmError::Refused(code, msg)) => {
            assert_eq!(code, -13);
            assert!(msg.contains("kv.shm_allowed_uids"), "{msg}");
        }
        Err(e) => panic!("expected a refusal, got {e:?}"),
        Ok(_) => panic!("a peer of another uid was let in"),
    }
    assert_eq!(
        metric_value(&mg.metrics(), "moongate_kv_shm_denied_total"),
        1.0
    );
    let mut http = moongate_kv::Client::connect_unix(&sock).unwrap();
    http.put("shm/ok", b"fine").unwrap();
    assert_eq!(http.get("shm/ok").unwrap().as_deref(), Some(&b"fine"[..]));
}

/// Values in another client's segment move over TE-TCP straight into and out of the
/// registered memory: a real Mooncake client's values (put through moongate's master
/// face) read into a memfd byte-exact, and values put from the memfd read back by that
/// client.
#[test]
fn shared_memory_reads_and_writes_remote_segments_byte_exact() {
    let master = Master::start();
    let dir = tempdir();
    let sock = dir.path().join("kv.sock");
    // No own segment: every value is in the Python peer's.
    let (mg, _kv) = kv_moongate(&master, &format!("unix_path = \"{}\"\n", sock.display()));
    let logs = [&master.proc, &mg.proc];
    // The peer reaches the master through moongate's master face, as vLLM's would.
    let mut peer = Background::start("kvpeer", &mg.listen, &master.metadata, &logs);
    let len = 8u64 << 20;
    let fd = memfd(len, true);
    // SAFETY: test code: our own view of the memfd moongate maps.
    let view = unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        std::slice::from_raw_parts_mut(p.cast::<u8>(), len as usize)
    };
    let mut c = moongate_kv::shm::ShmConn::connect(sock.to_str().unwrap()).unwrap();
    let region = c.region(fd.as_raw_fd(), len as usize).unwrap();
    let big = (3 << 20) + 7;
    assert_eq!(
        c.get_into(region, 1000, 4 << 20, "py/big").unwrap(),
        big as u64
    );
    assert!(
        view[1000..1000 + big] == value_of("py/big", big)[..],
        "py/big differs"
    );
    let got = c
        .batch_get_into(region, &[(0, 5000, "py/small"), (8192, 5000, "nope")])
        .unwrap();
    assert_eq!(got, [5000, -2]);
    assert!(
        view[..5000] == value_of("py/small", 5000)[..],
        "py/small differs"
    );
    // Puts from the memfd into the peer's segment (the pool's only one).
    let small = value_of("kv/small", 5000);
    let kbig = value_of("kv/big", big);
    view[..5000].copy_from_slice(&small);
    view[4 << 20..(4 << 20) + big].copy_from_slice(&kbig);
    c.put_from(region, 0, 5000, "kv/small").unwrap();
    c.put_from(region, 4 << 20, big as u64, "kv/big").unwrap();
    match c.put_from(region, 0, 5000, "kv/small") {
        Err(moongate_kv::shm::ShmError::Refused(-11, _)) => {}
        other => panic!("a second put of kv/small: {other:?}"),
    }
    // Released, the registration is gone from moongate; the next use registers anew.
    assert_eq!(registered(&mg), len as f64);
    c.release(fd.as_raw_fd()).unwrap();
    c.release(fd.as_raw_fd()).unwrap();
    assert_eq!(registered(&mg), 0.0);
    let region = c.region(fd.as_raw_fd(), len as usize).unwrap();
    assert_eq!(
        c.get_into(region, 0, 8192, "py/small").unwrap(),
        5000,
        "after a release"
    );
    let tcp = |dir: &str| {
        metric_value(
            &mg.metrics(),
            &format!("moongate_kv_transfers_total{{transport=\"tcp\",direction=\"{dir}\"}}"),
        )
    };
    assert!(
        tcp("read") >= 2.0 && tcp("write") >= 2.0,
        "{}",
        mg.metrics()
    );
    peer.tell();
    let r = peer.finish();
    for name in ["get kv/small", "get kv/big"] {
        assert_eq!(result(&r, name)["ok"], true, "{name}: {r}");
    }
    // SAFETY: test code: the view mapped above.
    unsafe {
        libc::munmap(view.as_mut_ptr().cast(), len as usize);
    }
}

/// The C library keys registrations by fd, and a freed mapping's fd comes back from the
/// next `mg_alloc`: a connection that another thread was using while `mg_free` ran
/// must not serve the new mapping with the old registration (moongate would write
/// into the freed memfd and the caller's new buffer would stay empty).
#[test]
fn a_free_while_another_thread_calls_never_reads_into_the_freed_memory() {
    use moongate_kv::capi::{mg_alloc, mg_close, mg_connect, mg_free, mg_get_into, mg_put};
    use std::ffi::CString;
    let master = Master::start();
    let dir = tempdir();
    let (_mg, _kv, sock) = kv_unix_moongate(&master, dir.path(), 64 << 20, "");
    let addr = CString::new(format!("unix:{}", sock.display())).unwrap();
    let (big_key, small_key) = (c"race/big", c"race/small");
    let (big, small) = (16usize << 20, 4096usize);
    let small_value = value_of("race/small", small);
    // SAFETY: test code, calling the C API by its contract (live handle, buffers from
    // mg_alloc of the stated sizes, each freed once).
    unsafe {
        let c = mg_connect(addr.as_ptr());
        assert!(!c.is_null());
        let a = mg_alloc(c, big).cast::<u8>();
        assert!(!a.is_null());
        std::slice::from_raw_parts_mut(a, big).fill(7);
        assert_eq!(mg_put(c, big_key.as_ptr(), a.cast(), big), 0);
        std::ptr::copy_nonoverlapping(small_value.as_ptr(), a, small);
        assert_eq!(mg_put(c, small_key.as_ptr(), a.cast(), small), 0);
        let (ca, aa) = (c as usize, a as usize);
        for round in 0..20 {
            // b is registered on the (only) idle shared-memory connection ...
            let b = mg_alloc(c, 1 << 20);
            assert_eq!(mg_get_into(c, small_key.as_ptr(), b, small), small as i64);
            // ... which a long read on another thread takes while b is freed and a new
            // mapping (most likely on b's fd number) is made.
            let (tx, rx) = std::sync::mpsc::channel();
            let long = std::thread::spawn(move || {
                tx.send(()).unwrap();
                mg_get_into(ca as *mut _, big_key.as_ptr(), aa as *mut _, big)
            });
            rx.recv().unwrap();
            std::thread::sleep(Duration::from_micros(300));
            assert_eq!(mg_free(c, b), 0);
            let nb = mg_alloc(c, 1 << 20);
            assert!(!nb.is_null());
            assert_eq!(long.join().unwrap(), big as i64);
            assert_eq!(mg_get_into(c, small_key.as_ptr(), nb, small), small as i64);
            assert!(
                std::slice::from_raw_parts(nb.cast::<u8>(), small) == &small_value[..],
                "round {round}: the new mapping did not get the value"
            );
            assert_eq!(mg_free(c, nb), 0);
        }
        mg_close(c);
    }
}
