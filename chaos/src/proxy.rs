//! A seeded UDP fault proxy: relays datagrams between clients and one upstream address, adding
//! delay, jitter, loss, reordering and duplication drawn from a seeded RNG. This machine's kernel
//! has no `tc netem`, so tests put this between QUIC endpoints instead.
//!
//! Each client address gets its own upstream socket (like a NAT), so the upstream's replies go
//! back to the client that caused them. The same seed and the same arrival order give the same
//! faults; real scheduling still varies arrival order, so a run is reproducible in its fault
//! *rates*, not packet for packet.

use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_kernels::tensor::Rng;

/// Largest datagram relayed (QUIC keeps packets well below this).
pub const DATAGRAM_BYTES_MAX: usize = 65_535;
/// Datagrams held back for delay at once; beyond this, new ones are dropped (and counted).
pub const DELAYED_MAX: usize = 65_536;
/// How long the relay loop sleeps when no datagram arrived (bounds added latency and idle CPU).
const IDLE_SLEEP_US: u64 = 100;

/// Faults applied to every datagram, in both directions.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LinkFaults {
    /// Fixed one-way delay.
    pub delay_ms: u64,
    /// Extra uniform random delay in `0..=jitter_ms` (reorders datagrams when > 0).
    pub jitter_ms: u64,
    /// Probability that a datagram is dropped.
    pub loss: f64,
    /// Probability that a datagram is held back an extra `reorder_ms` (overtaken by later ones).
    pub reorder: f64,
    pub reorder_ms: u64,
    /// Probability that a datagram is sent twice.
    pub duplicate: f64,
}

/// What the proxy did, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProxyStats {
    pub relayed: u64,
    pub dropped: u64,
    pub reordered: u64,
    pub duplicated: u64,
    pub overflowed: u64,
}

#[derive(Default)]
struct Counters {
    relayed: AtomicU64,
    dropped: AtomicU64,
    reordered: AtomicU64,
    duplicated: AtomicU64,
    overflowed: AtomicU64,
}

/// A running proxy; stops and joins its thread on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    thread: Option<JoinHandle<()>>,
}

/// A datagram due at `due`, to go out of `via` (None = the listening socket) to `to`.
struct Pending {
    due: Instant,
    seq: u64,
    to: SocketAddr,
    via: Option<SocketAddr>,
    data: Vec<u8>,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.due, self.seq) == (o.due, o.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    /// Earliest first in a max-heap.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (o.due, o.seq).cmp(&(self.due, self.seq))
    }
}

impl FaultProxy {
    /// Listens on `listen` (port 0 picks one) and relays to `upstream`.
    pub fn start(listen: SocketAddr, upstream: SocketAddr, faults: LinkFaults, seed: u64) -> io::Result<FaultProxy> {
        let front = UdpSocket::bind(listen)?;
        front.set_nonblocking(true)?;
        let addr = front.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let relay = Relay {
            front,
            upstream,
            faults,
            rng: Rng::new(seed),
            backs: HashMap::new(),
            delayed: BinaryHeap::new(),
            seq: 0,
            counters: Arc::clone(&counters),
        };
        let stop_flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name(format!("fault-proxy-{}", addr.port())).spawn(move || relay.run(&stop_flag))?;
        Ok(FaultProxy { addr, stop, counters, thread: Some(thread) })
    }

    /// The address clients send to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> ProxyStats {
        let c = &self.counters;
        ProxyStats {
            relayed: c.relayed.load(Ordering::Relaxed),
            dropped: c.dropped.load(Ordering::Relaxed),
            reordered: c.reordered.load(Ordering::Relaxed),
            duplicated: c.duplicated.load(Ordering::Relaxed),
            overflowed: c.overflowed.load(Ordering::Relaxed),
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Relay {
    front: UdpSocket,
    upstream: SocketAddr,
    faults: LinkFaults,
    rng: Rng,
    /// Client address → the upstream-facing socket that serves it.
    backs: HashMap<SocketAddr, UdpSocket>,
    delayed: BinaryHeap<Pending>,
    seq: u64,
    counters: Arc<Counters>,
}

impl Relay {
    fn run(mut self, stop: &AtomicBool) {
        let mut buf = vec![0u8; DATAGRAM_BYTES_MAX];
        while !stop.load(Ordering::SeqCst) {
            let mut busy = false;
            // Client → upstream: drain what the kernel holds, so its buffer never overflows.
            while let Ok((n, from)) = self.front.recv_from(&mut buf) {
                busy = true;
                let data = buf[..n].to_vec();
                if self.back_for(from).is_some() {
                    self.schedule(self.upstream, Some(from), data);
                }
            }
            // Upstream → clients.
            let clients: Vec<SocketAddr> = self.backs.keys().copied().collect();
            for client in clients {
                while let Some(Ok((n, _))) = self.backs.get(&client).map(|s| s.recv_from(&mut buf)) {
                    busy = true;
                    let data = buf[..n].to_vec();
                    self.schedule(client, None, data);
                }
            }
            self.flush_due();
            if !busy {
                std::thread::sleep(Duration::from_micros(IDLE_SLEEP_US));
            }
        }
    }

    fn back_for(&mut self, client: SocketAddr) -> Option<&UdpSocket> {
        if !self.backs.contains_key(&client) {
            let bind: SocketAddr = if self.upstream.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().ok()?;
            let s = UdpSocket::bind(bind).ok()?;
            s.set_nonblocking(true).ok()?;
            self.backs.insert(client, s);
        }
        self.backs.get(&client)
    }

    /// Applies the faults to one datagram and queues its copies.
    fn schedule(&mut self, to: SocketAddr, via: Option<SocketAddr>, data: Vec<u8>) {
        let f = self.faults;
        if self.rng.next_f64() < f.loss {
            self.counters.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let copies = if self.rng.next_f64() < f.duplicate {
            self.counters.duplicated.fetch_add(1, Ordering::Relaxed);
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut delay_ms = f.delay_ms + if f.jitter_ms > 0 { self.rng.gen_range(f.jitter_ms + 1) } else { 0 };
            if self.rng.next_f64() < f.reorder {
                delay_ms += f.reorder_ms;
                self.counters.reordered.fetch_add(1, Ordering::Relaxed);
            }
            if self.delayed.len() >= DELAYED_MAX {
                self.counters.overflowed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.seq += 1;
            self.delayed.push(Pending {
                due: Instant::now() + Duration::from_millis(delay_ms),
                seq: self.seq,
                to,
                via,
                data: data.clone(),
            });
        }
    }

    fn flush_due(&mut self) {
        let now = Instant::now();
        while self.delayed.peek().is_some_and(|p| p.due <= now) {
            let Some(p) = self.delayed.pop() else { break };
            let sent = match p.via {
                Some(client) => self.backs.get(&client).map(|s| s.send_to(&p.data, p.to)),
                None => Some(self.front.send_to(&p.data, p.to)),
            };
            if matches!(sent, Some(Ok(_))) {
                self.counters.relayed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo_server() -> (SocketAddr, Arc<AtomicBool>, JoinHandle<()>) {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.set_read_timeout(Some(Duration::from_millis(5))).unwrap();
        let addr = s.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let t = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !flag.load(Ordering::SeqCst) {
                if let Ok((n, from)) = s.recv_from(&mut buf) {
                    let _ = s.send_to(&buf[..n], from);
                }
            }
        });
        (addr, stop, t)
    }

    /// Sends `n` numbered datagrams through the proxy and collects the echoes.
    fn exchange(faults: LinkFaults, n: u32) -> (Vec<u32>, ProxyStats) {
        let (server, stop, t) = echo_server();
        let proxy = FaultProxy::start("127.0.0.1:0".parse().unwrap(), server, faults, 7).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        for i in 0..n {
            client.send_to(&i.to_le_bytes(), proxy.addr()).unwrap();
            if i % 16 == 15 {
                // Pace the sender so no socket buffer on the way overflows.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let mut got = Vec::new();
        let mut buf = [0u8; 16];
        while let Ok((len, _)) = client.recv_from(&mut buf) {
            if len == 4 {
                got.push(u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]));
            }
        }
        let stats = proxy.stats();
        drop(proxy);
        stop.store(true, Ordering::SeqCst);
        t.join().unwrap();
        (got, stats)
    }

    #[test]
    fn a_clean_link_relays_everything_in_order() {
        let (got, stats) = exchange(LinkFaults::default(), 200);
        assert_eq!(got, (0..200).collect::<Vec<_>>());
        assert_eq!(stats.dropped, 0);
        assert_eq!(stats.relayed, 400, "both directions");
    }

    #[test]
    fn faults_drop_duplicate_and_reorder_at_their_rates() {
        let faults = LinkFaults { delay_ms: 1, jitter_ms: 3, loss: 0.1, reorder: 0.2, reorder_ms: 10, duplicate: 0.1 };
        let (got, stats) = exchange(faults, 1000);
        // Two passes (there and back): ~19% lost, ~10% duplicated on each.
        assert!((100..=320).contains(&stats.dropped), "{stats:?}");
        assert!(stats.duplicated > 50, "{stats:?}");
        assert!(stats.reordered > 100, "{stats:?}");
        assert!(got.windows(2).any(|w| w[1] < w[0]), "some datagrams should arrive out of order");
        let mut unique = got.clone();
        unique.sort_unstable();
        unique.dedup();
        assert!(unique.len() < 1000 && got.len() > unique.len(), "losses and duplicates both visible");
    }
}
