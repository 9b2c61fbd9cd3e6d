//! A seeded UDP fault proxy: relays datagrams between clients and one upstream address, adding
//! delay, jitter, loss, reordering and duplication drawn from a seeded RNG. This machine's kernel
//! has no `tc netem`, so tests put this between QUIC endpoints instead.
//!
//! Each client address gets its own upstream socket (like a NAT), so the upstream's replies go
//! back to the client that caused them. The same seed and the same arrival order give the same
//! faults; real scheduling still varies arrival order, so a run is reproducible in its fault
//! *rates*, not packet for packet.
//!
//! A proxy can also stand in front of *all* of an endpoint's traffic, the connections it dials
//! included: [`FaultProxy::alias`] gives, for a remote address, the local address of that
//! remote's upstream socket; the endpoint sends there instead of to the remote, and the proxy
//! relays it out of its listening socket (so the remote sees the proxy's address, the one the
//! endpoint advertises). The faults can change while the proxy runs ([`FaultProxy::set_faults`]).

use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_kernels::tensor::Rng;

/// Largest datagram relayed (QUIC keeps packets well below this).
pub const DATAGRAM_BYTES_MAX: usize = 65_535;
/// Datagrams held back for delay at once; beyond this, new ones are dropped (and counted).
pub const DELAYED_MAX: usize = 65_536;
/// Upstream sockets (clients and aliases) one proxy keeps at most; datagrams from further
/// clients are dropped (and counted as overflowed).
pub const CLIENTS_MAX: usize = 256;
/// Longest the relay sleeps in `poll(2)` with nothing due (ms): bounds how late it sees the
/// stop flag.
const POLL_MAX_MS: i32 = 50;
/// Socket buffers asked for (bytes, each way): a relay a few milliseconds behind a QUIC sender
/// must not lose datagrams the faults did not choose to drop.
const SOCKET_BUFFER_BYTES: libc::c_int = 4 << 20;

/// Faults applied to every datagram, in both directions.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
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

impl LinkFaults {
    /// Whether these faults leave datagrams alone.
    pub fn is_clean(&self) -> bool {
        *self == LinkFaults::default()
    }
}

/// What the proxy did, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProxyStats {
    pub relayed: u64,
    pub dropped: u64,
    pub reordered: u64,
    pub duplicated: u64,
    pub overflowed: u64,
}

impl ProxyStats {
    /// Field-wise sum.
    pub fn add(&mut self, o: &ProxyStats) {
        self.relayed += o.relayed;
        self.dropped += o.dropped;
        self.reordered += o.reordered;
        self.duplicated += o.duplicated;
        self.overflowed += o.overflowed;
    }
}

#[derive(Default)]
struct Counters {
    relayed: AtomicU64,
    dropped: AtomicU64,
    reordered: AtomicU64,
    duplicated: AtomicU64,
    overflowed: AtomicU64,
}

/// Where a proxy listens and relays to, and how.
#[derive(Clone, Copy, Debug)]
pub struct ProxyOptions {
    /// The listening socket (port 0 picks one): clients send here.
    pub listen: SocketAddr,
    pub upstream: SocketAddr,
    pub faults: LinkFaults,
    pub seed: u64,
    /// The address the per-client upstream sockets bind (port 0 each); unspecified binds every
    /// interface. [`FaultProxy::alias`] needs a concrete one (the endpoint sends to it).
    pub back_ip: IpAddr,
    /// Never fragment on the listening socket (`IP_PMTUDISC_DO`): a datagram larger than the
    /// path's MTU is dropped, as a real link would, instead of split. Needed when the upstream
    /// is on loopback (MTU 64 KiB) and the clients across an Ethernet-sized link, so the
    /// endpoint's path-MTU discovery finds the real link's size.
    pub no_fragment: bool,
}

/// A running proxy; stops and joins its thread on drop.
pub struct FaultProxy {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    counters: Arc<Counters>,
    setting: Arc<Mutex<Setting>>,
    backs: Arc<Mutex<Backs>>,
    /// Bumped whenever `backs` grows, so the relay refreshes its copy.
    backs_gen: Arc<AtomicU64>,
    back_ip: IpAddr,
    /// Wakes the relay out of `poll(2)` (a new alias, new faults, stop).
    wake: UnixDatagram,
    thread: Option<JoinHandle<()>>,
}

/// The faults in force and, when they changed, the seed to restart the RNG from.
struct Setting {
    faults: LinkFaults,
    reseed: Option<u64>,
}

/// Client address → the upstream-facing socket that serves it.
type Backs = HashMap<SocketAddr, Arc<UdpSocket>>;

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Asks for [`SOCKET_BUFFER_BYTES`] each way (best effort: the forced variant needs root, the
/// plain one is capped by `net.core.{r,w}mem_max`).
fn size_buffers(s: &UdpSocket) {
    let fd = s.as_raw_fd();
    let v = SOCKET_BUFFER_BYTES;
    for opt in [libc::SO_RCVBUFFORCE, libc::SO_RCVBUF, libc::SO_SNDBUFFORCE, libc::SO_SNDBUF] {
        // SAFETY: setsockopt on a socket we own, with a pointer to a live c_int and its size.
        unsafe {
            libc::setsockopt(fd, libc::SOL_SOCKET, opt, (&v as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as u32);
        }
    }
}

/// `IP_PMTUDISC_DO` on an IPv4 socket: never fragment, refuse what exceeds the path MTU.
fn forbid_fragments(s: &UdpSocket) -> io::Result<()> {
    let v: libc::c_int = libc::IP_PMTUDISC_DO;
    // SAFETY: setsockopt on a socket we own, with a pointer to a live c_int and its size.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as u32,
        )
    };
    match rc {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

fn bind_back(ip: IpAddr) -> io::Result<UdpSocket> {
    let s = UdpSocket::bind((ip, 0))?;
    s.set_nonblocking(true)?;
    size_buffers(&s);
    Ok(s)
}

impl FaultProxy {
    /// Listens on `listen` (port 0 picks one) and relays to `upstream`; the per-client sockets
    /// bind every interface.
    pub fn start(listen: SocketAddr, upstream: SocketAddr, faults: LinkFaults, seed: u64) -> io::Result<FaultProxy> {
        let back_ip = if upstream.is_ipv4() { IpAddr::V4(Ipv4Addr::UNSPECIFIED) } else { IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED) };
        FaultProxy::start_with(ProxyOptions { listen, upstream, faults, seed, back_ip, no_fragment: false })
    }

    pub fn start_with(o: ProxyOptions) -> io::Result<FaultProxy> {
        let front = UdpSocket::bind(o.listen)?;
        front.set_nonblocking(true)?;
        size_buffers(&front);
        if o.no_fragment && o.listen.is_ipv4() {
            forbid_fragments(&front)?;
        }
        let addr = front.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let counters = Arc::new(Counters::default());
        let setting = Arc::new(Mutex::new(Setting { faults: o.faults, reseed: None }));
        let backs: Arc<Mutex<Backs>> = Arc::new(Mutex::new(HashMap::new()));
        let backs_gen = Arc::new(AtomicU64::new(0));
        let (wake, wake_rx) = UnixDatagram::pair()?;
        wake.set_nonblocking(true)?;
        wake_rx.set_nonblocking(true)?;
        let relay = Relay {
            front,
            upstream: o.upstream,
            back_ip: o.back_ip,
            faults: o.faults,
            setting: Arc::clone(&setting),
            rng: Rng::new(o.seed),
            backs: Arc::clone(&backs),
            backs_gen: Arc::clone(&backs_gen),
            local: HashMap::new(),
            local_gen: u64::MAX,
            fds: Vec::new(),
            wake: wake_rx,
            delayed: BinaryHeap::new(),
            seq: 0,
            counters: Arc::clone(&counters),
        };
        let stop_flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new().name(format!("fault-proxy-{}", addr.port())).spawn(move || relay.run(&stop_flag))?;
        Ok(FaultProxy { addr, stop, counters, setting, backs, backs_gen, back_ip: o.back_ip, wake, thread: Some(thread) })
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

    /// Applies `faults` to every datagram from now on, drawing from a generator restarted at
    /// `seed` (datagrams already held back keep their times).
    pub fn set_faults(&self, faults: LinkFaults, seed: u64) {
        *lock(&self.setting) = Setting { faults, reseed: Some(seed) };
        let _ = self.wake.send(&[0]);
    }

    /// The local address at which the upstream reaches `remote` through this proxy: datagrams
    /// the upstream sends there leave the listening socket for `remote` (with the faults), and
    /// `remote`'s datagrams to the listening socket come to the upstream from there. Needs a
    /// concrete [`ProxyOptions::back_ip`].
    pub fn alias(&self, remote: SocketAddr) -> io::Result<SocketAddr> {
        if self.back_ip.is_unspecified() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "this proxy binds its upstream sockets on every interface: no alias address",
            ));
        }
        let mut backs = lock(&self.backs);
        if let Some(s) = backs.get(&remote) {
            return s.local_addr();
        }
        if backs.len() >= CLIENTS_MAX {
            return Err(io::Error::other(format!("the proxy serves {CLIENTS_MAX} remotes already (CLIENTS_MAX)")));
        }
        let s = bind_back(self.back_ip)?;
        let a = s.local_addr()?;
        backs.insert(remote, Arc::new(s));
        self.backs_gen.fetch_add(1, Ordering::SeqCst);
        drop(backs);
        let _ = self.wake.send(&[0]);
        Ok(a)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.wake.send(&[0]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Relay {
    front: UdpSocket,
    upstream: SocketAddr,
    back_ip: IpAddr,
    faults: LinkFaults,
    setting: Arc<Mutex<Setting>>,
    rng: Rng,
    backs: Arc<Mutex<Backs>>,
    backs_gen: Arc<AtomicU64>,
    /// The relay's copy of `backs` (as of `local_gen`) and the `poll(2)` set built from it.
    local: Backs,
    local_gen: u64,
    fds: Vec<libc::pollfd>,
    wake: UnixDatagram,
    delayed: BinaryHeap<Pending>,
    seq: u64,
    counters: Arc<Counters>,
}

impl Relay {
    fn run(mut self, stop: &AtomicBool) {
        let mut buf = vec![0u8; DATAGRAM_BYTES_MAX];
        let mut clients: Vec<(SocketAddr, Arc<UdpSocket>)> = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            {
                let mut s = lock(&self.setting);
                if let Some(seed) = s.reseed.take() {
                    self.faults = s.faults;
                    self.rng = Rng::new(seed);
                }
            }
            if self.refresh() {
                clients = self.local.iter().map(|(a, s)| (*a, Arc::clone(s))).collect();
            }
            // Client → upstream: drain what the kernel holds, so its buffer never overflows.
            while let Ok((n, from)) = self.front.recv_from(&mut buf) {
                let data = buf[..n].to_vec();
                if self.back_for(from).is_some() {
                    self.schedule(self.upstream, Some(from), data);
                }
            }
            // Upstream → clients (fresh aliases are picked up on the next round).
            for (client, s) in &clients {
                while let Ok((n, _)) = s.recv_from(&mut buf) {
                    let data = buf[..n].to_vec();
                    self.schedule(*client, None, data);
                }
            }
            self.flush_due();
            self.wait();
        }
    }

    /// Takes the shared map of upstream sockets when it grew; returns whether it did.
    fn refresh(&mut self) -> bool {
        let g = self.backs_gen.load(Ordering::SeqCst);
        if g == self.local_gen {
            return false;
        }
        self.local = lock(&self.backs).clone();
        self.local_gen = g;
        self.fds = [self.front.as_raw_fd(), self.wake.as_raw_fd()]
            .into_iter()
            .chain(self.local.values().map(|s| s.as_raw_fd()))
            .map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 })
            .collect();
        true
    }

    /// Sleeps in `poll(2)` until a socket is readable, the next held-back datagram is due, or
    /// [`POLL_MAX_MS`] passed.
    fn wait(&mut self) {
        let timeout_ms = match self.delayed.peek() {
            Some(p) => {
                let left = p.due.saturating_duration_since(Instant::now());
                // Round up: waking early would only spin.
                (left.as_micros().div_ceil(1000) as i32).min(POLL_MAX_MS)
            }
            None => POLL_MAX_MS,
        };
        // SAFETY: `fds` is a live, correctly sized array of pollfd for sockets this relay holds
        // (`local` keeps every one of them open).
        unsafe {
            libc::poll(self.fds.as_mut_ptr(), self.fds.len() as libc::nfds_t, timeout_ms);
        }
        let mut sink = [0u8; 64];
        while self.wake.recv(&mut sink).is_ok() {}
    }

    fn back_for(&mut self, client: SocketAddr) -> Option<Arc<UdpSocket>> {
        if let Some(s) = self.local.get(&client) {
            return Some(Arc::clone(s));
        }
        let mut backs = lock(&self.backs);
        if let Some(s) = backs.get(&client) {
            return Some(Arc::clone(s));
        }
        if backs.len() >= CLIENTS_MAX {
            self.counters.overflowed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let s = Arc::new(bind_back(self.back_ip).ok()?);
        backs.insert(client, Arc::clone(&s));
        self.backs_gen.fetch_add(1, Ordering::SeqCst);
        Some(s)
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
            if delay_ms == 0 && self.delayed.is_empty() {
                // Nothing held back that it could overtake: out at once.
                self.send(to, via, &data);
                continue;
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
            self.send(p.to, p.via, &p.data);
        }
    }

    /// Sends one datagram out of `via`'s upstream socket (or the listening socket).
    fn send(&self, to: SocketAddr, via: Option<SocketAddr>, data: &[u8]) {
        let sent = match via {
            Some(client) => match self.local.get(&client) {
                Some(s) => Some(s.send_to(data, to)),
                None => lock(&self.backs).get(&client).map(|s| s.send_to(data, to)),
            },
            None => Some(self.front.send_to(data, to)),
        };
        if matches!(sent, Some(Ok(_))) {
            self.counters.relayed.fetch_add(1, Ordering::Relaxed);
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

    #[test]
    fn an_endpoint_behind_the_proxy_dials_out_through_aliases_and_faults_change_live() {
        let (remote, stop, t) = echo_server();
        let endpoint = UdpSocket::bind("127.0.0.1:0").unwrap();
        endpoint.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let lo = IpAddr::V4(Ipv4Addr::LOCALHOST);
        let o = ProxyOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            upstream: endpoint.local_addr().unwrap(),
            faults: LinkFaults::default(),
            seed: 3,
            back_ip: lo,
            no_fragment: true,
        };
        let proxy = FaultProxy::start_with(o).unwrap();
        let alias = proxy.alias(remote).unwrap();
        assert_eq!(proxy.alias(remote).unwrap(), alias, "one alias per remote");
        assert_eq!(alias.ip(), lo);
        let round = |n: u32| -> usize {
            let mut got = 0;
            let mut buf = [0u8; 16];
            for i in 0..n {
                endpoint.send_to(&i.to_le_bytes(), alias).unwrap();
                // The echo comes back from the alias: the endpoint sees the remote there.
                if let Ok((4, from)) = endpoint.recv_from(&mut buf) {
                    assert_eq!(from, alias);
                    got += 1;
                }
            }
            got
        };
        assert_eq!(round(20), 20, "a clean link relays both ways");
        proxy.set_faults(LinkFaults { loss: 1.0, ..LinkFaults::default() }, 9);
        assert_eq!(round(5), 0, "a link that drops everything");
        proxy.set_faults(LinkFaults::default(), 9);
        assert_eq!(round(20), 20, "the link is clean again");
        let s = proxy.stats();
        // The counter moves just after each send: the last echo may arrive before it.
        assert!(s.dropped >= 5 && s.relayed >= 78, "{s:?}");
        let plain = FaultProxy::start("127.0.0.1:0".parse().unwrap(), remote, LinkFaults::default(), 1).unwrap();
        assert!(plain.alias(remote).is_err(), "no alias on a proxy whose upstream sockets bind every interface");
        drop((proxy, plain));
        stop.store(true, Ordering::SeqCst);
        t.join().unwrap();
    }
}
