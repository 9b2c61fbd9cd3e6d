//! Loopback tests of the QUIC backend with real UDP sockets: every operation against the
//! in-process backend bit for bit, mTLS refusal, timeouts and a bulk-transfer measurement.

use super::*;
use crate::collective::{even_ranges, Collective, CollectiveError};
use crate::local::LocalGroup;
use crate::tree::TreeSum;
use quinn::Runtime as _;
use std::net::UdpSocket;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tessera_kernels::tensor::Rng;

const TEST_TIMEOUT_MS: u64 = 10_000;

fn temp_dir(what: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("tessera-quic-{what}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst)));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn names(world: usize) -> Vec<String> {
    (0..world).map(|r| format!("node-{r}")).collect()
}

/// Binds `world` loopback sockets and connects a group whose rank `r` uses `tls[r]`.
fn connect_all(tls: Vec<NodeTls>, timeout_ms: u64) -> Vec<Result<QuicComm, QuicError>> {
    let lanes = vec![1; tls.len()];
    connect_all_lanes(tls, timeout_ms, &lanes)
}

/// [`connect_all`] with rank `r` asking for `lanes[r]` connections per peer.
fn connect_all_lanes(tls: Vec<NodeTls>, timeout_ms: u64, lanes: &[usize]) -> Vec<Result<QuicComm, QuicError>> {
    let world = tls.len();
    let sockets: Vec<UdpSocket> = (0..world).map(|_| UdpSocket::bind("127.0.0.1:0").expect("bind loopback")).collect();
    let spec = ClusterSpec { addrs: sockets.iter().map(|s| s.local_addr().expect("addr")).collect(), names: names(world) };
    std::thread::scope(|s| {
        let handles: Vec<_> = sockets
            .into_iter()
            .zip(tls)
            .enumerate()
            .map(|(rank, (sock, tls))| {
                let spec = &spec;
                s.spawn(move || QuicComm::connect_socket_with_lanes(sock, rank, spec, &tls, timeout_ms, lanes[rank]))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("connect thread panicked")).collect()
    })
}

fn group(world: usize) -> Vec<QuicComm> {
    group_lanes(&vec![1; world])
}

/// A group whose rank `r` asks each peer for `lanes[r]` connections.
fn group_lanes(lanes: &[usize]) -> Vec<QuicComm> {
    let world = lanes.len();
    let dir = temp_dir("group");
    let n = names(world);
    cluster_init(&dir, &n.iter().map(String::as_str).collect::<Vec<_>>()).expect("cluster_init");
    let tls = n.iter().map(|name| NodeTls::load(&dir, name).expect("load")).collect();
    let comms = connect_all_lanes(tls, TEST_TIMEOUT_MS, lanes).into_iter().map(|c| c.expect("connect")).collect::<Vec<_>>();
    let _ = std::fs::remove_dir_all(&dir);
    comms
        .into_iter()
        .map(|mut c| {
            c.set_timeout_ms(TEST_TIMEOUT_MS);
            c
        })
        .collect()
}

fn run<C: Collective, T: Send>(comms: Vec<C>, f: impl Fn(&mut C) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let threads: Vec<_> = comms.into_iter().map(|mut c| s.spawn(move || f(&mut c))).collect();
        threads.into_iter().map(|t| t.join().expect("rank thread panicked")).collect()
    })
}

fn data(seed: u64, who: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng::derive(seed, &[who as u64]);
    (0..len).map(|_| rng.normal() * 10f32.powi((rng.gen_range(7) as i32) - 3)).collect()
}

fn uneven(len: usize, world: usize) -> Vec<Range<usize>> {
    // Sizes 0, 1, … then the rest on the last rank: empty and tiny ranges included.
    let mut ends: Vec<usize> = (0..world - 1).map(|r| (r * (r + 1) / 2).min(len)).collect();
    ends.push(len);
    (0..world).map(|r| if r == 0 { 0..ends[0] } else { ends[r - 1]..ends[r] }).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs every operation once and returns everything it produced, as bits.
fn every_op<C: Collective>(c: &mut C, len: usize) -> Vec<Vec<u64>> {
    let (rank, world) = (c.rank(), c.world());
    let to64 = |x: &[f32]| x.iter().map(|v| u64::from(v.to_bits())).collect::<Vec<_>>();
    let mine = data(3, rank, len);
    let mut out = Vec::new();
    let mut buf = mine.clone();
    c.all_reduce_sum(&mut buf).unwrap();
    out.push(to64(&buf));
    // A shorter one next, so reused buffers shrink (their old contents must not leak in).
    let mut short = data(5, rank, len / 2 + 1);
    c.all_reduce_sum(&mut short).unwrap();
    out.push(to64(&short));
    let mut buf64: Vec<f64> = mine.iter().map(|&v| f64::from(v) * 1.1).collect();
    c.all_reduce_sum_f64(&mut buf64).unwrap();
    out.push(buf64.iter().map(|v| v.to_bits()).collect());
    for ranges in [even_ranges(len, world), uneven(len, world)] {
        let mut rs = vec![0.0; ranges[rank].len()];
        c.reduce_scatter_sum(&mine, &ranges, &mut rs).unwrap();
        out.push(to64(&rs));
        let mut full = vec![0.0; len];
        c.all_gather(&mine[ranges[rank].clone()], &ranges, &mut full).unwrap();
        out.push(to64(&full));
        let mut slices = vec![Vec::new(); world];
        c.gather_slices(&mine, &ranges, &mut slices).unwrap();
        out.extend(slices.iter().map(|s| to64(s)));
    }
    for root in 0..world {
        let mut b = mine.clone();
        c.broadcast(&mut b, root).unwrap();
        out.push(to64(&b));
    }
    let sends: Vec<Vec<f32>> = (0..world).map(|j| data(4, rank * 10 + j, j + rank)).collect();
    let recv = c.all_to_all(&sends.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
    out.extend(recv.iter().map(|r| to64(r)));
    c.barrier().unwrap();
    let s = c.stats();
    out.push(vec![s.bytes_sent, s.bytes_received, s.ops]);
    out
}

#[test]
fn every_op_matches_the_local_backend_bit_for_bit() {
    for (world, len) in [(1, 100), (2, 1000), (3, 37), (4, 2500)] {
        let want = run(LocalGroup::with_timeout_ms(world, TEST_TIMEOUT_MS), |c| every_op(c, len));
        let got = run(group(world), |c| every_op(c, len));
        for rank in 0..world {
            assert_eq!(got[rank].len(), want[rank].len());
            for (i, (g, w)) in got[rank].iter().zip(&want[rank]).enumerate() {
                assert_eq!(g, w, "world {world} rank {rank} output {i}");
            }
        }
    }
}

#[test]
fn broadcast_of_several_pieces_and_a_large_all_reduce_match() {
    let len = (1 << 20) * 2 + 77; // three broadcast pieces
    let f = |c: &mut dyn Collective| {
        let mut b = data(9, c.rank(), len);
        c.broadcast(&mut b, 1).unwrap();
        let mut a = data(10, c.rank(), len);
        c.all_reduce_sum(&mut a).unwrap();
        (bits(&b), bits(&a))
    };
    let want = run(LocalGroup::with_timeout_ms(3, TEST_TIMEOUT_MS), |c| f(c));
    let got = run(group(3), |c| f(c));
    assert!(got == want, "QUIC results differ from the in-process backend");
}

/// Payloads cut into stripes over several connections per pair (and pairs that agreed on
/// different numbers of lanes) give the in-process backend's bits: every element is still
/// summed in rank order.
#[test]
fn striped_payloads_over_several_lanes_match_the_local_backend() {
    // Each rank's part of the all-reduce is ~3.3 MiB (3 stripes), the broadcast's 4 MiB pieces
    // 3 stripes and a ragged last piece, the uneven ranges parts of every size down to empty.
    let len = 2_500_000 + 77;
    let f = |c: &mut dyn Collective| {
        let (rank, world) = (c.rank(), c.world());
        let mut a = data(11, rank, len);
        c.all_reduce_sum(&mut a).unwrap();
        let mut b = data(12, rank, len);
        c.broadcast(&mut b, world - 1).unwrap();
        let ranges = vec![0..0, 0..3, 3..len / 2, len / 2..len][4 - world..].to_vec();
        let ranges: Vec<Range<usize>> = match world {
            4 => ranges,
            _ => even_ranges(len, world),
        };
        let mine = data(13, rank, len);
        let mut rs = vec![0.0; ranges[rank].len()];
        c.reduce_scatter_sum(&mine, &ranges, &mut rs).unwrap();
        let mut full = vec![0.0; len];
        c.all_gather(&mine[ranges[rank].clone()], &ranges, &mut full).unwrap();
        let mut f64s: Vec<f64> = mine.iter().map(|&v| f64::from(v) / 3.0).collect();
        c.all_reduce_sum_f64(&mut f64s).unwrap();
        (bits(&a), bits(&b), bits(&rs), bits(&full), f64s.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), c.stats())
    };
    for lanes in [vec![3, 3, 3], vec![4, 2, 4, 3]] {
        let world = lanes.len();
        let want = run(LocalGroup::with_timeout_ms(world, TEST_TIMEOUT_MS), |c| f(c));
        let comms = group_lanes(&lanes);
        for (r, c) in comms.iter().enumerate() {
            let pairs: Vec<usize> = (0..world).map(|p| if p == r { 0 } else { lanes[p].min(lanes[r]) }).collect();
            assert_eq!(c.lanes(), pairs, "rank {r}'s lanes with lanes asked {lanes:?}");
        }
        let got = run(comms, |c| f(c));
        for rank in 0..world {
            assert!(got[rank] == want[rank], "lanes {lanes:?}: rank {rank}'s results differ from the in-process backend");
        }
    }
}

#[test]
fn a_bad_number_of_lanes_is_refused_before_connecting() {
    let dir = temp_dir("lanes");
    cluster_init(&dir, &["node-0"]).unwrap();
    let tls = NodeTls::load(&dir, "node-0").unwrap();
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let spec = ClusterSpec { addrs: vec![sock.local_addr().unwrap()], names: names(1) };
    let r = QuicComm::connect_socket_with_lanes(sock, 0, &spec, &tls, 1_000, 0);
    assert!(matches!(&r, Err(QuicError::Spec { detail, .. }) if detail.contains("0 lanes") && detail.contains("1 to 8")), "{r:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every count the transport reads from the environment (lanes, runtime workers) is a number in
/// its range or an error naming the variable, the value and what was expected — never the
/// default in silence. (The values are passed in: setting the process's environment would race
/// with the other tests' connects, which read it.)
#[test]
fn bad_transport_variables_are_errors_naming_them() {
    use net::env_count;
    use std::env::VarError;
    let count = |v: Result<String, VarError>| env_count(net::WORKERS_ENV, v, 1..=net::WORKERS_MAX, "worker threads");
    assert_eq!(count(Err(VarError::NotPresent)), Ok(None));
    assert_eq!(count(Ok(" 3 ".into())), Ok(Some(3)));
    assert_eq!(count(Ok("64".into())), Ok(Some(64)));
    for bad in ["0", "65", "-1", "two", "", "1.5"] {
        let e = count(Ok(bad.into())).expect_err(bad);
        assert_eq!(e, format!("TESSERA_QUIC_WORKERS={bad:?}: expected a number of worker threads from 1 to 64"));
    }
    use std::os::unix::ffi::OsStringExt;
    let e = count(Err(VarError::NotUnicode(std::ffi::OsString::from_vec(vec![b'4', 0xff])))).expect_err("not UTF-8");
    assert!(e.starts_with("TESSERA_QUIC_WORKERS=") && e.contains("\\xFF") && e.ends_with("from 1 to 64"), "{e}");
    let e = env_count(net::LANES_ENV, Ok("9".into()), 1..=net::LANES_MAX, "lanes").expect_err("9 lanes");
    assert_eq!(e, "TESSERA_QUIC_LANES=\"9\": expected a number of lanes from 1 to 8");
}

#[test]
fn point_to_point_matches_tags_in_order() {
    let got = run(group(3), |c| {
        let (rank, world) = (c.rank(), c.world());
        let next = (rank + 1) % world;
        for i in 0..5 {
            c.send(next, 7, &[i as f32, rank as f32]).unwrap();
            c.send(next, 8, &vec![-1.0; i * 1000]).unwrap();
        }
        c.send(rank, 1, &[42.0]).unwrap();
        let prev = (rank + world - 1) % world;
        let tag8: Vec<usize> = (0..5).map(|_| c.recv(prev, 8).unwrap().len()).collect();
        let tag7: Vec<Vec<f32>> = (0..5).map(|_| c.recv(prev, 7).unwrap()).collect();
        (tag7, tag8, c.recv(rank, 1).unwrap())
    });
    for (rank, (tag7, tag8, own)) in got.iter().enumerate() {
        let prev = (rank + 2) % 3;
        assert_eq!(tag7, &(0..5).map(|i| vec![i as f32, prev as f32]).collect::<Vec<_>>());
        assert_eq!(tag8, &(0..5).map(|i| i * 1000).collect::<Vec<_>>());
        assert_eq!(own, &vec![42.0]);
    }
}

#[test]
fn gather_slices_with_tree_sum_is_independent_of_world_size() {
    let (m, len) = (8, 37);
    let leaf = |i: usize| data(7, 1000 + i, len);
    let mut serial = TreeSum::new();
    (0..m).for_each(|i| serial.push_leaf(leaf(i)).unwrap());
    let want = bits(&serial.finish().unwrap());
    for world in [2, 4] {
        let ranges = uneven(len, world);
        let per = m / world;
        let got = run(group(world), |c| {
            let mut block = TreeSum::new();
            (0..per).for_each(|i| block.push_leaf(leaf(c.rank() * per + i)).unwrap());
            let block = block.finish().unwrap();
            let mut tree = TreeSum::new();
            let level = per.trailing_zeros();
            c.gather_slices_with(&block, &ranges, &mut |r, s| tree.push_block(r * per, level, s.to_vec()).unwrap()).unwrap();
            let mut full = vec![0.0; len];
            c.all_gather(&tree.finish().unwrap(), &ranges, &mut full).unwrap();
            bits(&full)
        });
        assert!(got.iter().all(|g| g == &want), "world {world}");
    }
}

#[test]
fn disagreements_are_mismatches_on_every_rank_and_the_group_goes_on() {
    let got = run(group(3), |c| {
        let mut buf = vec![1.0; 10 + usize::from(c.rank() == 2)];
        let a = c.all_reduce_sum(&mut buf);
        let b = if c.rank() == 1 { c.barrier() } else { c.broadcast(&mut [0.0; 3], 0) };
        let mut ok = vec![c.rank() as f32; 4];
        c.all_reduce_sum(&mut ok).unwrap();
        (a, b, ok)
    });
    for (a, b, ok) in got {
        assert!(matches!(a, Err(CollectiveError::Mismatch { .. })), "{a:?}");
        assert!(matches!(b, Err(CollectiveError::Mismatch { .. })), "{b:?}");
        assert_eq!(ok, vec![3.0; 4]);
    }
}

#[test]
fn a_missing_peer_times_out_and_aborts_the_group() {
    let got = run(group(3), |c| {
        c.set_timeout_ms(300);
        if c.rank() == 2 {
            // Waits for a message that never comes; by then the others have aborted.
            std::thread::sleep(std::time::Duration::from_millis(600));
            return c.barrier();
        }
        c.barrier()
    });
    assert!(got.iter().take(2).all(|r| matches!(r, Err(CollectiveError::Timeout { .. } | CollectiveError::Aborted { .. }))), "{got:?}");
    assert!(got[..2].iter().any(|r| matches!(r, Err(CollectiveError::Timeout { .. }))), "{got:?}");
    assert!(matches!(got[2], Err(CollectiveError::Aborted { .. })), "{:?}", got[2]);
}

#[test]
fn abort_wakes_a_waiting_peer() {
    let mut comms = group(2);
    let handle = comms[0].abort_handle();
    let mut c1 = comms.pop().expect("two ranks");
    let waiter = std::thread::spawn(move || c1.recv(0, 5));
    std::thread::sleep(std::time::Duration::from_millis(100));
    handle.abort("supervisor says stop");
    let r = waiter.join().expect("waiter panicked");
    assert!(matches!(&r, Err(CollectiveError::Aborted { reason, .. }) if reason.contains("supervisor says stop")), "{r:?}");
    assert!(matches!(comms[0].barrier(), Err(CollectiveError::Aborted { .. })));
}

#[test]
fn a_dropped_peer_is_reported_and_its_messages_still_arrive() {
    let mut comms = group(2);
    let mut c1 = comms.pop().expect("two ranks");
    let mut c0 = comms.pop().expect("two ranks");
    c1.send(0, 3, &[1.0, 2.0]).unwrap();
    drop(c1);
    assert_eq!(c0.recv(1, 3).unwrap(), vec![1.0, 2.0]);
    assert!(matches!(c0.recv(1, 3), Err(CollectiveError::PeerGone { peer: 1, .. })));
}

#[test]
fn cluster_init_refuses_to_overwrite_and_rejects_bad_names() {
    let dir = temp_dir("init");
    let files = cluster_init(&dir, &["a", "b"]).unwrap();
    assert_eq!(files.nodes.len(), 2);
    // Private keys are the owner's alone; certificates are public.
    let mode = |p: &std::path::Path| std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions()) & 0o777;
    assert_eq!(mode(&files.ca_key), 0o600);
    for (_, cert, key) in &files.nodes {
        assert_eq!((mode(key), mode(cert) & 0o600), (0o600, 0o600), "{}", key.display());
    }
    assert!(matches!(cluster_init(&dir, &["c"]), Err(PkiError::CaExists { .. })));
    assert!(matches!(cluster_init(&temp_dir("bad"), &["x y"]), Err(PkiError::BadName { .. })));
    assert!(matches!(cluster_init(&temp_dir("dup"), &["a", "a"]), Err(PkiError::BadName { .. })));
    assert!(matches!(NodeTls::load(&dir, "zzz"), Err(PkiError::Io { .. })));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_certificate_from_a_foreign_ca_is_refused() {
    let (good, evil) = (temp_dir("good"), temp_dir("evil"));
    cluster_init(&good, &["node-0", "node-1"]).unwrap();
    cluster_init(&evil, &["node-0", "node-1"]).unwrap();
    let read = |d: &PathBuf, f: &str| std::fs::read_to_string(d.join(f)).unwrap();
    // Rank 1 trusts the real CA (so it accepts rank 0's server) but presents a foreign cert:
    // only rank 0's client-certificate check can stop it.
    let forged = NodeTls::from_pem(&read(&good, "ca.pem"), &read(&evil, "node-1.pem"), &read(&evil, "node-1.key")).unwrap();
    // A refusal comes at once; the bound only lets rank 0 stop waiting (generous for a loaded CI).
    let r = connect_all(vec![NodeTls::load(&good, "node-0").unwrap(), forged], 4_000);
    assert!(r.iter().all(|c| c.is_err()), "a foreign certificate was accepted");
    // Refused for its certificate, not merely slow: rank 1 hears why from rank 0's handshake.
    let why: Vec<String> = r.iter().filter_map(|c| c.as_ref().err().map(|e| e.to_string())).collect();
    assert!(why.iter().any(|e| e.contains("invalid peer certificate")), "{why:?}");
    // A certificate of the right CA but for another node name is refused as that rank.
    let wrong_name = NodeTls::load(&good, "node-0").unwrap();
    let r = connect_all(vec![NodeTls::load(&good, "node-0").unwrap(), wrong_name], 4_000);
    assert!(r.iter().all(|c| c.is_err()), "rank 1 was accepted with node-0's certificate");
    let why: Vec<String> = r.iter().filter_map(|c| c.as_ref().err().map(|e| e.to_string())).collect();
    assert!(why.iter().any(|e| e.contains("is not issued to \"node-1\"")), "{why:?}");
    // The right CA and names connect.
    let r = connect_all(vec![NodeTls::load(&good, "node-0").unwrap(), NodeTls::load(&good, "node-1").unwrap()], TEST_TIMEOUT_MS);
    assert!(r.iter().all(|c| c.is_ok()), "{:?}", r.iter().map(|c| c.as_ref().err().map(|e| e.to_string())).collect::<Vec<_>>());
    let _ = (std::fs::remove_dir_all(&good), std::fs::remove_dir_all(&evil));
}

#[test]
fn garbage_on_a_stream_closes_only_that_connection() {
    let comms = group(2);
    let conn = comms[1].conns_for_test(0);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut s = conn.open_uni().await.unwrap();
        s.write_all(&[5, 0, 0, 0, 1, 2, 3, 4, 5]).await.unwrap();
        s.finish().unwrap();
        conn.closed().await
    });
    let mut c0 = comms.into_iter().next().expect("rank 0");
    assert!(matches!(c0.recv(1, 0), Err(CollectiveError::PeerGone { peer: 1, .. })));
}

#[test]
fn bulk_all_gather_throughput_64_mib_two_ranks() {
    let len = 16 << 20; // 64 MiB of f32
    let ranges = even_ranges(len, 2);
    let secs = run(group(2), |c| {
        let shard = vec![c.rank() as f32; ranges[c.rank()].len()];
        let mut out = vec![0.0; len];
        c.all_gather(&shard, &ranges, &mut out).unwrap(); // warm-up (windows, MTU)
        let t = std::time::Instant::now();
        c.all_gather(&shard, &ranges, &mut out).unwrap();
        let s = t.elapsed().as_secs_f64();
        assert!(out[..ranges[0].end].iter().all(|&v| v == 0.0) && out[ranges[1].clone()].iter().all(|&v| v == 1.0));
        s
    });
    let s = secs.iter().cloned().fold(0.0, f64::max);
    let per_rank = (len / 2 * 4) as f64;
    eprintln!(
        "quic all_gather 64 MiB, 2 ranks: {s:.3} s, {:.1} MB/s received per rank, {:.1} MB/s total",
        per_rank / s / 1e6,
        2.0 * per_rank / s / 1e6
    );
}

/// Rank 1 of a two-rank group that completes the handshake (certificate, hello) and then never
/// reads a stream: once its windows are full, QUIC flow control stops every sender.
struct SilentPeer {
    rt: tokio::runtime::Runtime,
    conn: quinn::Connection,
    _endpoint: quinn::Endpoint,
}

/// Rank 0 as a real `QuicComm` and rank 1 as a [`SilentPeer`].
fn with_silent_peer() -> (QuicComm, SilentPeer) {
    let dir = temp_dir("silent");
    cluster_init(&dir, &["node-0", "node-1"]).expect("cluster_init");
    let (tls0, tls1) = (NodeTls::load(&dir, "node-0").unwrap(), NodeTls::load(&dir, "node-1").unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let (s0, s1) = (UdpSocket::bind("127.0.0.1:0").unwrap(), UdpSocket::bind("127.0.0.1:0").unwrap());
    let spec = ClusterSpec { addrs: vec![s0.local_addr().unwrap(), s1.local_addr().unwrap()], names: names(2) };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let (c0, peer) = std::thread::scope(|s| {
        let spec0 = spec.clone();
        let rank0 = s.spawn(move || QuicComm::connect_socket(s0, 0, &spec0, &tls0, TEST_TIMEOUT_MS).expect("rank 0 connects"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(TEST_TIMEOUT_MS);
        let (endpoint, conns) = rt.block_on(async {
            let runtime = Arc::new(quinn::TokioRuntime);
            let socket = runtime.wrap_udp_socket(s1).unwrap();
            let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls1.server_config().unwrap()).unwrap();
            let server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
            let endpoint = quinn::Endpoint::new_with_abstract_socket(net::endpoint_config(), Some(server), socket, runtime).unwrap();
            let conns = net::build_mesh(std::slice::from_ref(&endpoint), 1, &spec, &tls1, deadline).await.expect("rank 1 connects");
            (endpoint, conns)
        });
        let conn = conns[0].first().cloned().expect("a connection to rank 0");
        (rank0.join().expect("rank 0 panicked"), SilentPeer { rt, conn, _endpoint: endpoint })
    });
    (c0, peer)
}

/// Runs `f` on a thread and waits for it at most `bound`: a wait that never ends fails the test
/// instead of hanging it.
fn returns_within<T: Send + 'static>(bound: std::time::Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || drop(tx.send(f())));
    rx.recv_timeout(bound).unwrap_or_else(|_| panic!("did not return within {bound:?}"))
}

#[test]
fn abort_wakes_a_sender_blocked_by_flow_control_and_the_group_closes_at_once() {
    let (mut c0, peer) = with_silent_peer();
    c0.set_timeout_ms(600_000); // only the abort can end the send in time
    let handle = c0.abort_handle();
    let big = vec![1.0f32; 4 * net::STREAM_WINDOW_BYTES as usize / 4]; // 4 stream windows
    let sender = std::thread::spawn(move || {
        let r = c0.send(1, 9, &big);
        (r, c0)
    });
    // Let the send fill the peer's window and block on flow control.
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(!sender.is_finished(), "the send finished although the peer reads nothing");
    handle.abort("the supervisor lost a member");
    let (r, c0) = returns_within(std::time::Duration::from_secs(60), move || sender.join().expect("sender panicked"));
    assert!(matches!(&r, Err(CollectiveError::Aborted { op: "send", reason }) if reason.contains("lost a member")), "{r:?}");
    // Leaving an aborted group waits for no goodbye: the peer sees the connection closed as
    // aborted, with the reason (a graceful leave would close with "bye" after waiting for its acknowledgement).
    returns_within(std::time::Duration::from_secs(60), move || drop(c0));
    let closed = peer.rt.block_on(peer.conn.closed());
    match closed {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(c.error_code, quinn::VarInt::from_u32(net::CLOSE_ABORTED), "{c:?}");
            assert!(String::from_utf8_lossy(&c.reason).contains("lost a member"), "{c:?}");
        }
        other => panic!("the connection ended with {other:?}"),
    }
}

/// A collective's payload is lent to quinn, not copied (`quic::lend`). Here the peer announces
/// the all-gather, then its runtime stops (no reads, no acknowledgements), so quinn holds a
/// stream window's worth of the caller's shard unacknowledged when the group is aborted: the
/// abandoned stream must be reset (quinn then drops every lent piece) before the call returns.
/// Were a piece still held, `lend::lending` would abort the whole test process.
#[test]
fn an_aborted_all_gather_takes_back_what_it_lent_before_returning() {
    let (mut c0, peer) = with_silent_peer();
    c0.set_timeout_ms(600_000); // only the abort can end the call in time
    let handle = c0.abort_handle();
    let shard = vec![1.0f32; 4 * net::STREAM_WINDOW_BYTES as usize / 4]; // 4 stream windows
    let ranges = even_ranges(2 * shard.len(), 2);
    let desc = frame::OpDesc {
        op: crate::collective::CollectiveOp::AllGather as u8,
        lens: vec![2 * shard.len() as u64, shard.len() as u64],
        ends: ranges.iter().map(|r| r.end as u64).collect(),
        lanes: 1,
    };
    peer.rt.block_on(net::write_stream(&peer.conn, &frame::Control::Desc { seq: 0, desc }, &[])).expect("the peer announces the call");
    std::thread::sleep(std::time::Duration::from_millis(200)); // the announcement leaves
                                                               // The peer's only runtime worker sleeps: its connection acknowledges nothing meanwhile.
    peer.rt.spawn(async { std::thread::sleep(std::time::Duration::from_secs(3)) });
    let abandoned = lend::abandoned_streams();
    let caller = std::thread::spawn(move || {
        let mut out = vec![0f32; 2 * shard.len()];
        let r = c0.all_gather(&shard, &ranges, &mut out);
        drop(shard); // the caller's buffers go as soon as the call returns
        (r, c0)
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(!caller.is_finished(), "the all-gather finished although the peer acknowledged nothing");
    handle.abort("the supervisor lost a member");
    let (r, c0) = returns_within(std::time::Duration::from_secs(60), move || caller.join().expect("the caller panicked"));
    assert!(matches!(&r, Err(CollectiveError::Aborted { op: "all_gather", .. })), "{r:?}");
    assert!(lend::abandoned_streams() > abandoned, "no stream with lent pieces was reset: the failure path was not taken");
    drop(c0);
}

/// Both ends prefer TLS 1.3's AES-128-GCM (`pki::provider_named`), whichever crypto library
/// each uses, so that is what every connection's packets are sealed with (quinn does not report
/// the suite: this runs the same configs' handshake in memory).
#[test]
fn mutual_tls_negotiates_aes_128_gcm_with_either_crypto_provider() {
    for (server_side, client_side) in [("aws-lc-rs", "aws-lc-rs"), ("ring", "aws-lc-rs"), ("aws-lc-rs", "ring"), ("ring", "ring")] {
        handshake_negotiates_aes_128(server_side, client_side);
    }
    assert!(matches!(pki::provider_named("openssl"), Err(PkiError::Tls(e)) if e.contains("expected aws-lc-rs or ring")));
}

fn handshake_negotiates_aes_128(server_side: &str, client_side: &str) {
    let dir = temp_dir("suite");
    cluster_init(&dir, &["node-0", "node-1"]).unwrap();
    let server = NodeTls::load(&dir, "node-0").unwrap();
    let server = Arc::new(server.server_config_with(pki::ALPN, ClientAuth::Required, pki::provider_named(server_side).unwrap()).unwrap());
    let client = NodeTls::load(&dir, "node-1").unwrap();
    let client = Arc::new(client.client_config_with(pki::ALPN, pki::provider_named(client_side).unwrap()).unwrap());
    let mut c = rustls::ClientConnection::new(client, "node-0".try_into().unwrap()).unwrap();
    let mut s = rustls::ServerConnection::new(server).unwrap();
    let mut wire = Vec::new();
    for _ in 0..8 {
        wire.clear();
        c.write_tls(&mut wire).unwrap();
        s.read_tls(&mut &wire[..]).unwrap();
        s.process_new_packets().unwrap();
        wire.clear();
        s.write_tls(&mut wire).unwrap();
        c.read_tls(&mut &wire[..]).unwrap();
        c.process_new_packets().unwrap();
    }
    assert!(!c.is_handshaking() && !s.is_handshaking(), "the in-memory handshake did not finish");
    assert!(s.peer_certificates().is_some_and(|certs| !certs.is_empty()), "the client certificate was not required");
    let aes128 = Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    assert_eq!((c.negotiated_cipher_suite().map(|x| x.suite()), s.negotiated_cipher_suite().map(|x| x.suite())), (aes128, aes128));
    let _ = std::fs::remove_dir_all(&dir);
}
