//! Collective bandwidth and small-message latency between processes on loopback: QUIC (mTLS,
//! `QuicComm`) against a plain TCP ring moving the same bytes, in the same invocation.
//!
//! All-to-all (MoE token dispatch) has no ring algorithm worth the name, so its TCP peer is a
//! full mesh of the same blocking sockets: one stream per pair of ranks, each call writing every
//! peer's part on a helper thread while reading every peer's part on another.
//!
//! `collective_bench --control` measures the control plane instead: round trips of small frames
//! on a QUIC control connection (`ControlConn`, mutual TLS; request lane and actor lane) against
//! a TCP stream with the same framing, between two threads of this process on loopback.
//!
//! `collective_bench [--procs 2,4] [--mib 64] [--reps 5] [--only quic|tcp]` — the parent spawns
//! one child process per rank for each world size and prints a table. Bus bandwidth follows
//! NCCL's convention: all-gather and all-to-all `(N−1)/N · bytes / s`, all-reduce
//! `2(N−1)/N · bytes / s` (bytes: one rank's whole buffer). Each
//! row also gives the CPU time all ranks spent per call (user + system, from `/proc/self/stat`,
//! averaged over the timed repetitions), a measure of cost that load from other programs on the
//! machine disturbs much less than wall time. `--only` runs one transport (for profiling).
//!
//! The TCP ring is a plain, fair implementation of the same algorithms: blocking sockets with
//! `TCP_NODELAY`, each ring step writing from the tensor in place on a helper thread while the
//! caller reads into the tensor in place (all-gather) or reads 256 KiB chunks and adds them in
//! (reduce-scatter) — the same chunk size and the same number of memory passes as `QuicComm`
//! minus what QUIC itself adds. The all-reduce works on a byte buffer holding the f32 values.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use tessera_transport::collective::{even_ranges, Collective};
use tessera_transport::quic::control::{LANE_ACTORS, LANE_REQUESTS};
use tessera_transport::quic::{cluster_init, ClientAuth, ClusterSpec, ControlConn, ControlEndpoint, NodeTls, QuicComm, ALPN_CONTROL};

/// Small-message round trips measured for latency.
const PINGS: usize = 2000;
const PING_BYTES: usize = 64;
/// Bound on any socket wait in the TCP peer.
const TCP_TIMEOUT_MS: u64 = 60_000;
/// Bytes the TCP ring reads at a time in its reducing steps (`QuicComm` adds 256 KiB chunks too).
const TCP_CHUNK_BYTES: usize = 256 << 10;
/// Clock ticks per second of `/proc/self/stat` (`USER_HZ`, 100 on every Linux target).
const USER_HZ: f64 = 100.0;

/// Which transports a run measures.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Only {
    Both,
    Quic,
    Tcp,
}

impl Only {
    fn quic(self) -> bool {
        self != Only::Tcp
    }
    fn tcp(self) -> bool {
        self != Only::Quic
    }
    fn flag(self) -> &'static str {
        match self {
            Only::Both => "both",
            Only::Quic => "quic",
            Only::Tcp => "tcp",
        }
    }
}

struct Args {
    control: bool,
    procs: Vec<usize>,
    mib: usize,
    reps: usize,
    only: Only,
    child: Option<ChildArgs>,
}

struct ChildArgs {
    rank: usize,
    world: usize,
    certs: String,
    addrs: Vec<SocketAddr>,
    tcp: Vec<SocketAddr>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args { control: false, procs: vec![2, 4], mib: 64, reps: 5, only: Only::Both, child: None };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    let addrs =
        |s: &str| s.split(',').map(|x| x.parse().map_err(|e| format!("address `{x}`: {e}"))).collect::<Result<Vec<SocketAddr>, String>>();
    let num =
        |s: Option<&String>, what: &str| s.ok_or(format!("{what} needs a value"))?.parse::<usize>().map_err(|e| format!("{what}: {e}"));
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--bench" => {}
            "--control" => a.control = true,
            "--procs" => {
                a.procs = it
                    .next()
                    .ok_or("--procs needs a value")?
                    .split(',')
                    .map(|s| s.parse().map_err(|e| format!("--procs: {e}")))
                    .collect::<Result<_, _>>()?
            }
            "--mib" => a.mib = num(it.next(), "--mib")?,
            "--reps" => a.reps = num(it.next(), "--reps")?,
            "--only" => {
                a.only = match it.next().map(String::as_str) {
                    Some("quic") => Only::Quic,
                    Some("tcp") => Only::Tcp,
                    Some("both") => Only::Both,
                    other => return Err(format!("--only takes quic, tcp or both, not {other:?}")),
                }
            }
            "--child" => {
                let v: Vec<&String> = it.by_ref().take(5).collect();
                let [rank, world, certs, q, t] = v[..] else { return Err("--child RANK WORLD CERTS QUIC_ADDRS TCP_ADDRS".into()) };
                a.child = Some(ChildArgs {
                    rank: num(Some(rank), "rank")?,
                    world: num(Some(world), "world")?,
                    certs: certs.clone(),
                    addrs: addrs(q)?,
                    tcp: addrs(t)?,
                });
            }
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(a)
}

fn free_udp() -> SocketAddr {
    UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).expect("a free UDP port")
}

fn free_tcp() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0").and_then(|s| s.local_addr()).expect("a free TCP port")
}

/// A ring over TCP: a stream to the next rank and one from the previous.
struct TcpRing {
    rank: usize,
    world: usize,
    next: TcpStream,
    prev: TcpStream,
}

impl TcpRing {
    fn connect(rank: usize, world: usize, addrs: &[SocketAddr]) -> std::io::Result<TcpRing> {
        let listener = TcpListener::bind(addrs[rank])?;
        let to = addrs[(rank + 1) % world];
        let dial = std::thread::spawn(move || -> std::io::Result<TcpStream> {
            let deadline = Instant::now() + Duration::from_millis(TCP_TIMEOUT_MS);
            loop {
                match TcpStream::connect(to) {
                    Ok(s) => return Ok(s),
                    Err(e) if Instant::now() > deadline => return Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        let (prev, _) = listener.accept()?;
        let next = dial.join().map_err(|_| std::io::Error::other("dialer panicked"))??;
        for s in [&next, &prev] {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_millis(TCP_TIMEOUT_MS)))?;
        }
        Ok(TcpRing { rank, world, next, prev })
    }

    /// One ring step: writes `out` to the next rank on a helper thread while reading `inp` from
    /// the previous one.
    fn step(&mut self, out: &[u8], inp: &mut [u8]) -> std::io::Result<()> {
        let next = &self.next;
        std::thread::scope(|s| {
            let sender = s.spawn(move || (&mut &*next).write_all(out));
            self.prev.read_exact(inp)?;
            sender.join().map_err(|_| std::io::Error::other("sender panicked"))?
        })
    }

    /// One reducing ring step: writes `out` while reading the previous rank's part chunk by chunk
    /// into `tmp` and adding it into `acc` (f32 values, little-endian bytes).
    fn step_add(&mut self, out: &[u8], acc: &mut [u8], tmp: &mut [u8]) -> std::io::Result<()> {
        let next = &self.next;
        std::thread::scope(|s| {
            let sender = s.spawn(move || (&mut &*next).write_all(out));
            for a in acc.chunks_mut(tmp.len()) {
                let t = &mut tmp[..a.len()];
                self.prev.read_exact(t)?;
                add_f32_le(a, t);
            }
            sender.join().map_err(|_| std::io::Error::other("sender panicked"))?
        })
    }

    /// The byte range of part `k` of a buffer of `len` bytes cut into `world` equal parts.
    fn part(&self, k: usize, len: usize) -> std::ops::Range<usize> {
        let chunk = len / self.world;
        k * chunk..(k + 1) * chunk
    }

    /// Ring all-gather of equal parts, in place in `buf`.
    fn all_gather(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        let n = self.world;
        for s in 0..n - 1 {
            let (send, recv) = ((self.rank + n - s) % n, (self.rank + 2 * n - s - 1) % n);
            let (out, inp) = split_pair(buf, self.part(send, buf.len()), self.part(recv, buf.len()));
            self.step(out, inp)?;
        }
        Ok(())
    }

    /// Ring reduce-scatter (f32 sums) then ring all-gather, in place in `buf` (f32 values as
    /// little-endian bytes): the classic ring all-reduce.
    fn all_reduce(&mut self, buf: &mut [u8], tmp: &mut Vec<u8>) -> std::io::Result<()> {
        let n = self.world;
        tmp.resize(TCP_CHUNK_BYTES, 0);
        for s in 0..n - 1 {
            let (send, recv) = ((self.rank + n - s) % n, (self.rank + 2 * n - s - 1) % n);
            let (out, acc) = split_pair(buf, self.part(send, buf.len()), self.part(recv, buf.len()));
            self.step_add(out, acc, tmp)?;
        }
        // Rank r now holds the full sum of part r + 1; the gather starts from there.
        for s in 0..n - 1 {
            let (send, recv) = ((self.rank + 1 + n - s) % n, (self.rank + 2 * n - s) % n);
            let (out, inp) = split_pair(buf, self.part(send, buf.len()), self.part(recv, buf.len()));
            self.step(out, inp)?;
        }
        Ok(())
    }
}

/// A full mesh over TCP: one stream to every other rank (the all-to-all peer).
struct TcpMesh {
    rank: usize,
    peers: Vec<Option<TcpStream>>,
}

impl TcpMesh {
    /// Rank `r` dials every lower rank (announcing itself with its rank) and accepts every
    /// higher one, on the same addresses as the ring (bound again once the ring is up).
    fn connect(rank: usize, world: usize, addrs: &[SocketAddr]) -> std::io::Result<TcpMesh> {
        let listener = TcpListener::bind(addrs[rank])?;
        let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (to, addr) in addrs.iter().enumerate().take(rank) {
            let deadline = Instant::now() + Duration::from_millis(TCP_TIMEOUT_MS);
            let mut s = loop {
                match TcpStream::connect(addr) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() > deadline => return Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            };
            s.write_all(&(rank as u64).to_le_bytes())?;
            peers[to] = Some(s);
        }
        for _ in rank + 1..world {
            let (mut s, _) = listener.accept()?;
            let mut who = [0u8; 8];
            s.read_exact(&mut who)?;
            let from = u64::from_le_bytes(who) as usize;
            match peers.get_mut(from) {
                Some(slot @ None) if from > rank => *slot = Some(s),
                _ => return Err(std::io::Error::other(format!("a mesh connection announced rank {from}"))),
            }
        }
        for s in peers.iter().flatten() {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(Duration::from_millis(TCP_TIMEOUT_MS)))?;
        }
        Ok(TcpMesh { rank, peers })
    }

    /// `recv[p] ← part p sent by rank p` for every peer, `send[p]` going to rank p (own part copied).
    fn all_to_all(&mut self, send: &[Vec<u8>], recv: &mut [Vec<u8>]) -> std::io::Result<()> {
        let rank = self.rank;
        recv[rank].copy_from_slice(&send[rank]);
        let peers = &self.peers;
        std::thread::scope(|sc| {
            let writer = sc.spawn(move || -> std::io::Result<()> {
                // Write to each peer in turn starting after this rank, so no two ranks write to
                // the same peer first.
                let n = peers.len();
                for k in 1..n {
                    let p = (rank + k) % n;
                    (&mut peers[p].as_ref().expect("mesh peer")).write_all(&send[p])?;
                }
                Ok(())
            });
            let readers: Vec<_> = recv
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != rank)
                .map(|(p, buf)| {
                    let s = peers[p].as_ref().expect("mesh peer");
                    sc.spawn(move || (&mut &*s).read_exact(buf))
                })
                .collect();
            for r in readers {
                r.join().map_err(|_| std::io::Error::other("reader panicked"))??;
            }
            writer.join().map_err(|_| std::io::Error::other("writer panicked"))?
        })
    }
}

/// `acc += x` over f32 values stored as little-endian bytes.
fn add_f32_le(acc: &mut [u8], x: &[u8]) {
    for (a, b) in acc.chunks_exact_mut(4).zip(x.chunks_exact(4)) {
        let sum = f32::from_le_bytes([a[0], a[1], a[2], a[3]]) + f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        a.copy_from_slice(&sum.to_le_bytes());
    }
}

/// `(&buf[a], &mut buf[b])` for disjoint ranges.
fn split_pair(buf: &mut [u8], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&[u8], &mut [u8]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

/// CPU seconds (user + system, all threads) this process has used so far.
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which ends with the last ')'): utime and stime are the
    // 12th and 13th of them (fields 14 and 15 of the line).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest.split_whitespace().skip(11).take(2).filter_map(|x| x.parse().ok()).collect();
    f.iter().sum::<u64>() as f64 / USER_HZ
}

/// CPU seconds of each of this process's threads so far: (thread id, name, seconds).
fn thread_cpu() -> Vec<(u64, String, f64)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else { return Vec::new() };
    let mut v = Vec::new();
    for e in dir.flatten() {
        let Ok(tid) = e.file_name().to_string_lossy().parse::<u64>() else { continue };
        let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
        let (Some(open), Some((head, rest))) = (stat.find('('), stat.rsplit_once(')')) else { continue };
        let name = head[open + 1..].to_string();
        let f: Vec<u64> = rest.split_whitespace().skip(11).take(2).filter_map(|x| x.parse().ok()).collect();
        v.push((tid, name, f.iter().sum::<u64>() as f64 / USER_HZ));
    }
    v
}

/// With `COLLECTIVE_BENCH_THREADS=1`: each thread's CPU ms per call since `before`, on stderr
/// (which thread saturates first: the rank's own, or the runtime's).
fn report_threads(rank: usize, what: &str, before: &[(u64, String, f64)], calls: usize) {
    let mut parts = Vec::new();
    for (tid, name, s) in thread_cpu() {
        let s0 = before.iter().find(|(t, _, _)| *t == tid).map_or(0.0, |b| b.2);
        if s - s0 > 0.0 {
            parts.push(format!("{name}/{tid} {:.0}", (s - s0) * 1e3 / calls.max(1) as f64));
        }
    }
    eprintln!("threads rank {rank} {what} (CPU ms per call): {}", parts.join(", "));
}

/// Wall time of the best of `reps` calls (after a warm-up), and this process's CPU time per call.
struct Timing {
    best_s: f64,
    cpu_s: f64,
}

fn measure(reps: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<Timing, String> {
    f()?; // warm-up
    let mut best = f64::INFINITY;
    let cpu0 = cpu_s();
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(Timing { best_s: best, cpu_s: (cpu_s() - cpu0) / reps.max(1) as f64 })
}

/// A transport left out of the run (`--only`): no figures.
const SKIPPED: Timing = Timing { best_s: f64::NAN, cpu_s: f64::NAN };

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs on each rank; rank 0 prints one result line per measurement.
/// Runs on each rank: every rank prints its CPU time per call; rank 0 also prints bandwidth and
/// latency. Each result is checked, so that neither transport can win by skipping work.
fn child(c: &ChildArgs, mib: usize, reps: usize, only: Only) -> Result<(), String> {
    let names: Vec<String> = (0..c.world).map(|r| format!("rank{r}")).collect();
    let tls = NodeTls::load(std::path::Path::new(&c.certs), &names[c.rank]).map_err(|e| e.to_string())?;
    let spec = ClusterSpec { addrs: c.addrs.clone(), names };
    let mut q = QuicComm::connect(c.rank, &spec, &tls, 30_000).map_err(|e| e.to_string())?;
    let mut tcp = TcpRing::connect(c.rank, c.world, &c.tcp).map_err(|e| format!("tcp ring: {e}"))?;
    let n = mib * 1024 * 1024 / 4 / c.world * c.world;
    let bytes = (n * 4) as f64;
    let f = (c.world as f64 - 1.0) / c.world as f64;
    let ranges = even_ranges(n, c.world);
    let calls = reps as i32 + 1; // with the warm-up
    let wrong = |what: &str| Err(format!("rank {}: wrong {what} result", c.rank));

    let mut out = vec![0.0f32; n];
    let shard = vec![c.rank as f32; ranges[c.rank].len()];
    let threads = std::env::var("COLLECTIVE_BENCH_THREADS").is_ok_and(|v| v == "1");
    let t0 = thread_cpu();
    let ag_q = match only.quic() {
        true => measure(reps, || q.all_gather(&shard, &ranges, &mut out).map_err(|e| e.to_string()))?,
        false => SKIPPED,
    };
    if threads && only.quic() {
        report_threads(c.rank, "QUIC all_gather", &t0, reps + 1);
    }
    if only.quic() && !ranges.iter().enumerate().all(|(r, range)| out[range.clone()].iter().all(|&v| v == r as f32)) {
        return wrong("QUIC all_gather");
    }
    let mut raw = vec![0u8; n * 4];
    raw[tcp.part(c.rank, n * 4)].fill(c.rank as u8 + 1);
    let ag_t = match only.tcp() {
        true => measure(reps, || tcp.all_gather(&mut raw).map_err(|e| e.to_string()))?,
        false => SKIPPED,
    };
    if only.tcp() && !(0..c.world).all(|r| raw[tcp.part(r, n * 4)].iter().all(|&b| b == r as u8 + 1)) {
        return wrong("TCP all_gather");
    }
    drop((out, raw));

    let want = (c.world as f32).powi(calls); // ones summed over the ranks, once per call
    let mut buf = vec![1.0f32; n];
    let t0 = thread_cpu();
    let ar_q = match only.quic() {
        true => measure(reps, || q.all_reduce_sum(&mut buf).map_err(|e| e.to_string()))?,
        false => SKIPPED,
    };
    if threads && only.quic() {
        report_threads(c.rank, "QUIC all_reduce", &t0, reps + 1);
    }
    if only.quic() && !buf.iter().all(|&v| v == want) {
        return wrong("QUIC all_reduce");
    }
    drop(buf);
    let mut tbuf: Vec<u8> = std::iter::repeat_n(1.0f32.to_le_bytes(), n).flatten().collect();
    let mut tmp = Vec::new();
    let ar_t = match only.tcp() {
        true => measure(reps, || tcp.all_reduce(&mut tbuf, &mut tmp).map_err(|e| e.to_string()))?,
        false => SKIPPED,
    };
    if only.tcp() && !tbuf.chunks_exact(4).all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) == want) {
        return wrong("TCP all_reduce");
    }
    drop(tbuf);

    // All-to-all: part p of this rank's buffer goes to rank p; each value says (from, to).
    let part = n / c.world;
    let tag = |from: usize, to: usize| (from * 1000 + to) as f32;
    let sends: Vec<Vec<f32>> = (0..c.world).map(|p| vec![tag(c.rank, p); part]).collect();
    let mut got_q: Vec<Vec<f32>> = Vec::new();
    let aa_q = match only.quic() {
        true => measure(reps, || {
            let refs: Vec<&[f32]> = sends.iter().map(Vec::as_slice).collect();
            got_q = q.all_to_all(&refs).map_err(|e| e.to_string())?;
            Ok(())
        })?,
        false => SKIPPED,
    };
    if only.quic()
        && !(got_q.len() == c.world && got_q.iter().enumerate().all(|(p, v)| v.len() == part && v.iter().all(|&x| x == tag(p, c.rank))))
    {
        return wrong("QUIC all_to_all");
    }
    drop((sends, got_q));
    let mut mesh = TcpMesh::connect(c.rank, c.world, &c.tcp).map_err(|e| format!("tcp mesh: {e}"))?;
    let tsends: Vec<Vec<u8>> = (0..c.world).map(|p| std::iter::repeat_n(tag(c.rank, p).to_le_bytes(), part).flatten().collect()).collect();
    let mut trecv: Vec<Vec<u8>> = vec![vec![0u8; part * 4]; c.world];
    let aa_t = match only.tcp() {
        true => measure(reps, || mesh.all_to_all(&tsends, &mut trecv).map_err(|e| e.to_string()))?,
        false => SKIPPED,
    };
    let tcp_ok =
        trecv.iter().enumerate().all(|(p, v)| v.chunks_exact(4).all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) == tag(p, c.rank)));
    if only.tcp() && !tcp_ok {
        return wrong("TCP all_to_all");
    }
    drop((tsends, trecv, mesh));

    let (mut lat_q, mut lat_t) = (Vec::with_capacity(PINGS), Vec::with_capacity(PINGS));
    if c.world >= 2 && c.rank < 2 {
        let peer = 1 - c.rank;
        let msg = vec![0.5f32; PING_BYTES / 4];
        let mut byte_msg = [0u8; PING_BYTES];
        let mut tcp_pair = if c.rank == 0 { tcp.next.try_clone() } else { tcp.prev.try_clone() }.map_err(|e| e.to_string())?;
        for i in 0..PINGS as u64 {
            if !only.quic() {
                break;
            }
            let t = Instant::now();
            if c.rank == 0 {
                q.send(peer, i, &msg).map_err(|e| e.to_string())?;
                q.recv(peer, i).map_err(|e| e.to_string())?;
            } else {
                q.recv(peer, i).map_err(|e| e.to_string())?;
                q.send(peer, i, &msg).map_err(|e| e.to_string())?;
            }
            lat_q.push(t.elapsed().as_secs_f64() / 2.0);
        }
        // TCP ping-pong on the 0 → 1 ring link (rank 1 answers on its `prev` stream).
        for _ in 0..PINGS {
            if !only.tcp() {
                break;
            }
            let t = Instant::now();
            if c.rank == 0 {
                tcp_pair.write_all(&byte_msg).map_err(|e| e.to_string())?;
                tcp_pair.read_exact(&mut byte_msg).map_err(|e| e.to_string())?;
            } else {
                tcp_pair.read_exact(&mut byte_msg).map_err(|e| e.to_string())?;
                tcp_pair.write_all(&byte_msg).map_err(|e| e.to_string())?;
            }
            lat_t.push(t.elapsed().as_secs_f64() / 2.0);
        }
    }
    q.barrier().map_err(|e| e.to_string())?;
    if threads {
        for (peer, lanes) in q.connection_stats().iter().enumerate() {
            for (lane, st) in lanes.iter().enumerate() {
                let (p, f) = (&st.path, &st.frame_tx);
                eprintln!(
                    "conn rank {} → {peer} lane {lane}: sent {} packets ({} datagrams, {} MB), lost {} ({} B), congestion events {}, cwnd {} B, rtt {:?}, mtu {}; acks sent {}, max_data {}, max_stream_data {}, data_blocked {}, stream_data_blocked {}",
                    c.rank, p.sent_packets, st.udp_tx.datagrams, st.udp_tx.bytes / 1_000_000, p.lost_packets, p.lost_bytes,
                    p.congestion_events, p.cwnd, p.rtt, p.current_mtu, f.acks, f.max_data, f.max_stream_data, f.data_blocked, f.stream_data_blocked
                );
            }
        }
    }
    println!("RESULT cpu all_gather {} {} {}", c.world, ag_q.cpu_s, ag_t.cpu_s);
    println!("RESULT cpu all_reduce {} {} {}", c.world, ar_q.cpu_s, ar_t.cpu_s);
    println!("RESULT cpu all_to_all {} {} {}", c.world, aa_q.cpu_s, aa_t.cpu_s);
    if c.rank == 0 {
        let gbs = |factor: f64, s: f64| factor * bytes / s / 1e9;
        println!("RESULT bw all_gather {} {:.3} {:.3}", c.world, gbs(f, ag_q.best_s), gbs(f, ag_t.best_s));
        println!("RESULT bw all_reduce {} {:.3} {:.3}", c.world, gbs(2.0 * f, ar_q.best_s), gbs(2.0 * f, ar_t.best_s));
        println!("RESULT bw all_to_all {} {:.3} {:.3}", c.world, gbs(f, aa_q.best_s), gbs(f, aa_t.best_s));
        let us = |v: &mut Vec<f64>, p| if v.is_empty() { f64::NAN } else { percentile(v, p) * 1e6 };
        println!(
            "RESULT latency {} {:.1} {:.1} {:.1} {:.1}",
            c.world,
            us(&mut lat_q, 0.5),
            us(&mut lat_q, 0.99),
            us(&mut lat_t, 0.5),
            us(&mut lat_t, 0.99)
        );
    }
    Ok(())
}

/// One table row: bandwidth from rank 0, CPU seconds per call summed over the ranks.
struct Row {
    op: String,
    world: usize,
    bw: (f64, f64),
    cpu: (f64, f64),
}

fn parent(a: &Args) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut rows: Vec<Row> = Vec::new();
    let mut latency = Vec::new();
    for &world in &a.procs {
        let certs = std::env::temp_dir().join(format!("tessera-bench-certs-{}-{world}", std::process::id()));
        let _ = std::fs::remove_dir_all(&certs);
        let names: Vec<String> = (0..world).map(|r| format!("rank{r}")).collect();
        cluster_init(&certs, &names.iter().map(String::as_str).collect::<Vec<_>>()).map_err(|e| e.to_string())?;
        let join = |v: Vec<SocketAddr>| v.iter().map(ToString::to_string).collect::<Vec<_>>().join(",");
        let (q, t) = (join((0..world).map(|_| free_udp()).collect()), join((0..world).map(|_| free_tcp()).collect()));
        let children: Vec<_> = (0..world)
            .map(|r| {
                Command::new(&exe)
                    .args([
                        "--mib",
                        &a.mib.to_string(),
                        "--reps",
                        &a.reps.to_string(),
                        "--only",
                        a.only.flag(),
                        "--child",
                        &r.to_string(),
                        &world.to_string(),
                        &certs.display().to_string(),
                        &q,
                        &t,
                    ])
                    .stdout(Stdio::piped())
                    .spawn()
                    .map_err(|e| e.to_string())
            })
            .collect::<Result<_, _>>()?;
        // Every child is waited for (their own waits are bounded), so none is left behind.
        let outputs: Vec<_> = children.into_iter().map(|c| c.wait_with_output()).collect();
        let _ = std::fs::remove_dir_all(&certs);
        let first = rows.len();
        for out in outputs {
            let out = out.map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(format!("a rank of world {world} failed ({})", out.status));
            }
            for line in String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.strip_prefix("RESULT ")) {
                let f: Vec<&str> = line.split_whitespace().collect();
                let num = |s: &str| s.parse::<f64>().unwrap_or(f64::NAN);
                match f[..] {
                    ["latency", w, q50, q99, t50, t99] => latency.push(format!("| {w} | {q50} | {q99} | {t50} | {t99} |")),
                    [kind, op, _, qv, tv] => {
                        let at = match rows[first..].iter().position(|r| r.op == op) {
                            Some(i) => first + i,
                            None => {
                                rows.push(Row { op: op.to_string(), world, bw: (0.0, 0.0), cpu: (0.0, 0.0) });
                                rows.len() - 1
                            }
                        };
                        match kind {
                            "bw" => rows[at].bw = (num(qv), num(tv)),
                            _ => rows[at].cpu = (rows[at].cpu.0 + num(qv), rows[at].cpu.1 + num(tv)),
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    println!("collectives between processes on loopback, {} MiB per call, best of {} (after a warm-up)", a.mib, a.reps);
    println!("| op | procs | QUIC bus GB/s | TCP bus GB/s (ring; mesh for all_to_all) | QUIC / TCP | QUIC CPU ms/call | TCP CPU ms/call |");
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {:.3} | {:.3} | {:.0} % | {:.0} | {:.0} |",
            r.op,
            r.world,
            r.bw.0,
            r.bw.1,
            100.0 * r.bw.0 / r.bw.1,
            r.cpu.0 * 1e3,
            r.cpu.1 * 1e3
        );
    }
    println!("\nsmall messages ({PING_BYTES} B, one way = half a round trip, {PINGS} round trips between ranks 0 and 1), µs:");
    println!("| procs | QUIC p50 | QUIC p99 | TCP p50 | TCP p99 |");
    println!("|---|---|---|---|---|");
    latency.iter().for_each(|l| println!("{l}"));
    Ok(())
}

/// Waits for the next frame on `lane` (bounded).
fn next_frame(c: &ControlConn, lane: usize) -> Result<Vec<u8>, String> {
    for _ in 0..600 {
        if let Some(f) = c.recv(lane, 100).map_err(|e| e.to_string())? {
            return Ok(f);
        }
    }
    Err("no frame within 60 s".into())
}

/// One-way times (half round trips, µs) of `PINGS` frames of `PING_BYTES` echoed on `lane`.
fn control_pings(client: &ControlConn, server: &ControlConn, lane: usize, actor: bool) -> Result<Vec<f64>, String> {
    let echo = server.clone();
    let echoer = std::thread::spawn(move || -> Result<(), String> {
        for _ in 0..PINGS + 100 {
            let f = next_frame(&echo, lane)?;
            match actor {
                true => echo.try_send(lane, f).map_err(|e| e.to_string())?,
                false => echo.send(lane, f).map_err(|e| e.to_string())?,
            }
        }
        Ok(())
    });
    let mut times = Vec::with_capacity(PINGS);
    for i in 0..PINGS + 100 {
        let msg = vec![i as u8; PING_BYTES];
        let t = Instant::now();
        match actor {
            true => client.try_send(lane, msg.clone()).map_err(|e| e.to_string())?,
            false => client.send(lane, msg.clone()).map_err(|e| e.to_string())?,
        }
        let back = next_frame(client, lane)?;
        if back != msg {
            return Err("a control frame came back changed".into());
        }
        if i >= 100 {
            times.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    echoer.join().map_err(|_| "the echo thread panicked".to_string())??;
    Ok(times)
}

/// The same round trips over a TCP stream with the TCP control framing (`[u32 LE len][frame]`).
fn tcp_pings() -> Result<Vec<f64>, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let echoer = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; 4 + PING_BYTES];
        for _ in 0..PINGS + 100 {
            s.read_exact(&mut buf)?;
            s.write_all(&buf)?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_nodelay(true).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_millis(TCP_TIMEOUT_MS))).map_err(|e| e.to_string())?;
    let mut times = Vec::with_capacity(PINGS);
    let mut frame = (PING_BYTES as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&[7u8; PING_BYTES]);
    let mut back = vec![0u8; frame.len()];
    for i in 0..PINGS + 100 {
        let t = Instant::now();
        s.write_all(&frame).and_then(|()| s.read_exact(&mut back)).map_err(|e| e.to_string())?;
        if i >= 100 {
            times.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    echoer.join().map_err(|_| "the echo thread panicked".to_string())?.map_err(|e| e.to_string())?;
    Ok(times)
}

/// `--control`: control-plane latency (see the module doc).
fn control_latency() -> Result<(), String> {
    let certs = std::env::temp_dir().join(format!("tessera-bench-control-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&certs);
    cluster_init(&certs, &["coordinator", "node-0"]).map_err(|e| e.to_string())?;
    let load = |n: &str| NodeTls::load(&certs, n).map_err(|e| e.to_string());
    let (co, node) = (load("coordinator")?, load("node-0")?);
    let _ = std::fs::remove_dir_all(&certs);
    let local: SocketAddr = ([127, 0, 0, 1], 0).into();
    let server_cfg = co.server_config_for(ALPN_CONTROL, ClientAuth::Required).map_err(|e| e.to_string())?;
    let server = ControlEndpoint::bind(local, Some(server_cfg)).map_err(|e| e.to_string())?;
    let addr = server.local_addr().map_err(|e| e.to_string())?;
    let accepter = std::thread::spawn(move || loop {
        match server.accept(100) {
            Ok(Some(c)) => return Ok((c, server)),
            Ok(None) => continue,
            Err(e) => return Err(e),
        }
    });
    let client_ep = ControlEndpoint::bind(local, None).map_err(|e| e.to_string())?;
    let client_cfg = node.client_config_for(ALPN_CONTROL).map_err(|e| e.to_string())?;
    let client = client_ep.connect(addr, "coordinator", client_cfg, 10_000).map_err(|e| e.to_string())?;
    let (srv, _server) = accepter.join().map_err(|_| "the accepting thread panicked".to_string())??;
    let mut rows = Vec::new();
    for (what, mut v) in [
        ("QUIC control, request lane (send)", control_pings(&client, &srv, LANE_REQUESTS, false)?),
        ("QUIC control, actor lane (try_send)", control_pings(&client, &srv, LANE_ACTORS, true)?),
        ("TCP stream, same framing", tcp_pings()?),
    ] {
        rows.push(format!("| {what} | {:.1} | {:.1} |", percentile(&mut v, 0.5), percentile(&mut v, 0.99)));
    }
    println!("control frames ({PING_BYTES} B, one way = half a round trip, {PINGS} round trips after 100 warm-up, two threads of one process), µs:");
    println!("| carrier | p50 | p99 |");
    println!("|---|---|---|");
    rows.iter().for_each(|r| println!("{r}"));
    client.close("done");
    Ok(())
}

fn main() -> ExitCode {
    let result = parse().and_then(|a| match &a.child {
        Some(c) => child(c, a.mib, a.reps, a.only),
        None if a.control => control_latency(),
        None => parent(&a),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("collective_bench: {e}");
            ExitCode::FAILURE
        }
    }
}
