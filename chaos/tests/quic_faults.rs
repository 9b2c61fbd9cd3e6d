//! Collectives over QUIC with mTLS still give the same bits when the links between the ranks
//! delay, drop, reorder and duplicate datagrams (each rank is reached through a fault proxy).

use std::net::{SocketAddr, UdpSocket};

use tessera_chaos::exercise::run_exercise;
use tessera_chaos::proxy::{FaultProxy, LinkFaults};
use tessera_transport::local::LocalGroup;
use tessera_transport::quic::{cluster_init, ClusterSpec, NodeTls, QuicComm};

const WORLD: usize = 3;

fn run_local() -> Vec<Vec<Vec<f32>>> {
    let comms = LocalGroup::new(WORLD);
    let handles: Vec<_> = comms.into_iter().map(|mut c| std::thread::spawn(move || run_exercise(&mut c).unwrap())).collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn collectives_over_faulty_quic_links_match_the_local_backend_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..WORLD).map(|r| format!("rank{r}")).collect();
    let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
    cluster_init(dir.path(), &name_refs).unwrap();
    let sockets: Vec<UdpSocket> = (0..WORLD).map(|_| UdpSocket::bind("127.0.0.1:0").unwrap()).collect();
    let real: Vec<SocketAddr> = sockets.iter().map(|s| s.local_addr().unwrap()).collect();
    let faults = LinkFaults { delay_ms: 1, jitter_ms: 2, loss: 0.02, reorder: 0.05, reorder_ms: 5, duplicate: 0.02 };
    let proxies: Vec<FaultProxy> = real
        .iter()
        .enumerate()
        .map(|(r, &a)| FaultProxy::start("127.0.0.1:0".parse().unwrap(), a, faults, 100 + r as u64).unwrap())
        .collect();
    // Every rank dials its peers through their proxies.
    let spec = ClusterSpec { addrs: proxies.iter().map(FaultProxy::addr).collect(), names: names.clone() };
    let handles: Vec<_> = sockets
        .into_iter()
        .enumerate()
        .map(|(r, socket)| {
            let (spec, dir, name) = (spec.clone(), dir.path().to_path_buf(), names[r].clone());
            std::thread::spawn(move || {
                let tls = NodeTls::load(&dir, &name).unwrap();
                let mut comm = QuicComm::connect_socket(socket, r, &spec, &tls, 30_000).unwrap();
                run_exercise(&mut comm).unwrap()
            })
        })
        .collect();
    let quic: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(quic, run_local(), "results over faulty QUIC links differ from the in-process backend");
    let stats: Vec<_> = proxies.iter().map(FaultProxy::stats).collect();
    assert!(stats.iter().map(|s| s.dropped).sum::<u64>() > 0, "the proxies dropped nothing: {stats:?}");
    assert!(stats.iter().map(|s| s.duplicated).sum::<u64>() > 0, "the proxies duplicated nothing: {stats:?}");
}
