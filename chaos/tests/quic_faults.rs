//! Collectives over QUIC with mTLS still give the same bits when the links between the ranks
//! delay, drop, reorder and duplicate datagrams (each rank is reached through a fault proxy).

use std::net::{SocketAddr, UdpSocket};

use tessera_chaos::exercise::run_exercise;
use tessera_chaos::proxy::{FaultProxy, LinkFaults};
use tessera_transport::collective::Collective;
use tessera_transport::local::LocalGroup;
use tessera_transport::quic::{cluster_init, ClusterSpec, NodeTls, QuicComm};

const WORLD: usize = 3;

/// What one rank produced: the exercise's values, and the large payloads' bits.
type Outputs = (Vec<Vec<f32>>, Vec<Vec<u32>>);

/// The exercise, then payloads large enough to be cut into stripes over several lanes (an
/// all-reduce of ~11 MiB, a broadcast of ~10 MiB), as bits.
fn exercise(c: &mut dyn Collective) -> Outputs {
    let small = run_exercise(c).unwrap();
    let rank = c.rank();
    let mut a: Vec<f32> = (0..3_000_001).map(|i| ((i * 31 + rank * 17) % 1009) as f32 / 13.0 - 30.0).collect();
    c.all_reduce_sum(&mut a).unwrap();
    let mut b: Vec<f32> = (0..2_500_000).map(|i| (i % 977) as f32 * (rank as f32 + 0.5)).collect();
    c.broadcast(&mut b, 1).unwrap();
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    (small, vec![bits(&a), bits(&b)])
}

fn run_local() -> Vec<Outputs> {
    let comms = LocalGroup::new(WORLD);
    let handles: Vec<_> = comms.into_iter().map(|mut c| std::thread::spawn(move || exercise(&mut c))).collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// Runs the exercise on `WORLD` ranks asking for `lanes` connections per peer, rank `r` reached
/// through a fault proxy when `behind_proxy[r]`; checks the bits against the in-process backend
/// and returns each rank's lanes per peer and the proxies' statistics.
fn run_through_proxies(behind_proxy: [bool; WORLD], lanes: usize) -> (Vec<Vec<usize>>, Vec<tessera_chaos::proxy::ProxyStats>) {
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..WORLD).map(|r| format!("rank{r}")).collect();
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    cluster_init(dir.path(), &name_refs).unwrap();
    let sockets: Vec<UdpSocket> = (0..WORLD).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
    let real: Vec<SocketAddr> = sockets.iter().map(|s| s.local_addr().unwrap()).collect();
    let faults = LinkFaults { delay_ms: 1, jitter_ms: 2, loss: 0.02, reorder: 0.05, reorder_ms: 5, duplicate: 0.02 };
    let proxies: Vec<Option<FaultProxy>> = real
        .iter()
        .enumerate()
        .map(|(r, &a)| behind_proxy[r].then(|| FaultProxy::start("127.0.0.1:0".parse().unwrap(), a, faults, 100 + r as u64).unwrap()))
        .collect();
    // Every rank dials a proxied peer through its proxy.
    let addrs = proxies.iter().zip(&real).map(|(p, &a)| p.as_ref().map_or(a, FaultProxy::addr)).collect();
    let spec = ClusterSpec { addrs, names: names.clone() };
    let handles: Vec<_> = sockets
        .into_iter()
        .enumerate()
        .map(|(r, socket)| {
            let (spec, dir, name) = (spec.clone(), dir.path().to_path_buf(), names[r].clone());
            std::thread::spawn(move || {
                let tls = NodeTls::load(&dir, &name).unwrap();
                let mut comm = QuicComm::connect_socket_with_lanes(socket, r, &spec, &tls, 30_000, lanes).unwrap();
                (exercise(&mut comm), comm.lanes())
            })
        })
        .collect();
    let (quic, lanes): (Vec<_>, Vec<_>) = handles.into_iter().map(|h| h.join().unwrap()).unzip();
    assert_eq!(quic, run_local(), "results over faulty QUIC links differ from the in-process backend");
    (lanes, proxies.iter().flatten().map(FaultProxy::stats).collect())
}

#[test]
fn collectives_over_faulty_quic_links_match_the_local_backend_bit_for_bit() {
    // Several lanes asked for, but a rank reached through a proxy offers one (its other lanes'
    // ports are not behind the proxy): every datagram crosses a faulty link.
    let (lanes, stats) = run_through_proxies([true; WORLD], 3);
    assert!(lanes.iter().enumerate().all(|(r, l)| l.iter().enumerate().all(|(p, &n)| n == usize::from(p != r))), "{lanes:?}");
    assert!(stats.iter().map(|s| s.dropped).sum::<u64>() > 0, "the proxies dropped nothing: {stats:?}");
    assert!(stats.iter().map(|s| s.duplicated).sum::<u64>() > 0, "the proxies duplicated nothing: {stats:?}");
}

#[test]
fn lanes_run_beside_a_faulty_link_and_the_bits_stay() {
    // Rank 1 behind a faulty proxy: a rank reached at another address than its socket's uses one
    // lane with everyone (its other lanes' sockets would bypass the proxy, or a fault link's
    // aliases); ranks 0 and 2 reach each other directly over 3 lanes, while the links to rank 1
    // are faulty. Every rank then receives single stripes (the fewest lanes it has with a peer).
    let (lanes, stats) = run_through_proxies([false, true, false], 3);
    assert_eq!(lanes, vec![vec![0, 1, 3], vec![1, 0, 1], vec![3, 1, 0]]);
    assert!(stats[0].dropped > 0 && stats[0].relayed > 0, "the proxy saw too little: {stats:?}");
}
