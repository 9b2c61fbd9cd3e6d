//! Collective bandwidth and small-message latency between processes on loopback: QUIC (mTLS,
//! `QuicComm`) against a plain TCP ring moving the same bytes, in the same invocation.
//!
//! `collective_bench [--procs 2,4] [--mib 64] [--reps 5]` — the parent spawns one child process
//! per rank for each world size and prints a table. Bus bandwidth follows NCCL's convention:
//! all-gather `(N−1)/N · bytes / s`, all-reduce `2(N−1)/N · bytes / s`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use tessera_transport::collective::{even_ranges, Collective};
use tessera_transport::quic::{cluster_init, ClusterSpec, NodeTls, QuicComm};

/// Small-message round trips measured for latency.
const PINGS: usize = 2000;
const PING_BYTES: usize = 64;
/// Bound on any socket wait in the TCP peer.
const TCP_TIMEOUT_MS: u64 = 60_000;

struct Args {
    procs: Vec<usize>,
    mib: usize,
    reps: usize,
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
    let mut a = Args { procs: vec![2, 4], mib: 64, reps: 5, child: None };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut it = argv.iter();
    let addrs =
        |s: &str| s.split(',').map(|x| x.parse().map_err(|e| format!("address `{x}`: {e}"))).collect::<Result<Vec<SocketAddr>, String>>();
    let num =
        |s: Option<&String>, what: &str| s.ok_or(format!("{what} needs a value"))?.parse::<usize>().map_err(|e| format!("{what}: {e}"));
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--bench" => {}
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

    /// One ring step: send `out` to the next rank while receiving `inp` from the previous.
    fn step(&mut self, out: &[u8], inp: &mut [u8]) -> std::io::Result<()> {
        let mut next = self.next.try_clone()?;
        let payload = out.to_vec();
        let sender = std::thread::spawn(move || next.write_all(&payload));
        self.prev.read_exact(inp)?;
        sender.join().map_err(|_| std::io::Error::other("sender panicked"))?
    }

    /// Ring all-gather of equal chunks (in place in `buf`).
    fn all_gather(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        let chunk = buf.len() / self.world;
        let mut tmp = vec![0u8; chunk];
        for s in 0..self.world - 1 {
            let send = (self.rank + self.world - s) % self.world;
            let recv = (self.rank + self.world - s - 1) % self.world;
            let out = buf[send * chunk..(send + 1) * chunk].to_vec();
            self.step(&out, &mut tmp)?;
            buf[recv * chunk..(recv + 1) * chunk].copy_from_slice(&tmp);
        }
        Ok(())
    }

    /// Ring reduce-scatter (f32 sums) then all-gather: the classic ring all-reduce.
    fn all_reduce(&mut self, buf: &mut [f32]) -> std::io::Result<()> {
        let chunk = buf.len() / self.world;
        let mut tmp = vec![0u8; chunk * 4];
        for s in 0..self.world - 1 {
            let send = (self.rank + self.world - s) % self.world;
            let recv = (self.rank + self.world - s - 1) % self.world;
            let out: Vec<u8> = buf[send * chunk..(send + 1) * chunk].iter().flat_map(|x| x.to_le_bytes()).collect();
            self.step(&out, &mut tmp)?;
            for (d, b) in buf[recv * chunk..(recv + 1) * chunk].iter_mut().zip(tmp.chunks_exact(4)) {
                *d += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        let mut bytes: Vec<u8> = buf.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.all_gather(&mut bytes)
    }
}

fn best_s(reps: usize, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    f()?; // warm-up
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(best)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Runs on each rank; rank 0 prints one result line per measurement.
fn child(c: &ChildArgs, mib: usize, reps: usize) -> Result<(), String> {
    let names: Vec<String> = (0..c.world).map(|r| format!("rank{r}")).collect();
    let tls = NodeTls::load(std::path::Path::new(&c.certs), &names[c.rank]).map_err(|e| e.to_string())?;
    let spec = ClusterSpec { addrs: c.addrs.clone(), names };
    let mut q = QuicComm::connect(c.rank, &spec, &tls, 30_000).map_err(|e| e.to_string())?;
    let mut tcp = TcpRing::connect(c.rank, c.world, &c.tcp).map_err(|e| format!("tcp ring: {e}"))?;
    let n = mib * 1024 * 1024 / 4 / c.world * c.world;
    let bytes = (n * 4) as f64;
    let (w, f) = (c.world as f64, (c.world as f64 - 1.0) / c.world as f64);
    let ranges = even_ranges(n, c.world);
    let mut out = vec![0.0f32; n];
    let shard = vec![1.0f32; ranges[c.rank].len()];
    let ag_q = best_s(reps, || q.all_gather(&shard, &ranges, &mut out).map_err(|e| e.to_string()))?;
    let mut raw = vec![0u8; n * 4];
    let ag_t = best_s(reps, || tcp.all_gather(&mut raw).map_err(|e| e.to_string()))?;
    let mut buf = vec![1.0f32; n];
    let ar_q = best_s(reps, || q.all_reduce_sum(&mut buf).map_err(|e| e.to_string()))?;
    let ar_t = best_s(reps, || tcp.all_reduce(&mut buf).map_err(|e| e.to_string()))?;
    let (mut lat_q, mut lat_t) = (Vec::with_capacity(PINGS), Vec::with_capacity(PINGS));
    if c.world >= 2 && c.rank < 2 {
        let peer = 1 - c.rank;
        let msg = vec![0.5f32; PING_BYTES / 4];
        let mut byte_msg = [0u8; PING_BYTES];
        let mut tcp_pair = if c.rank == 0 { tcp.next.try_clone() } else { tcp.prev.try_clone() }.map_err(|e| e.to_string())?;
        for i in 0..PINGS as u64 {
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
    if c.rank == 0 {
        let gbs = |factor: f64, s: f64| factor * bytes / s / 1e9;
        let _ = w;
        println!("RESULT all_gather {} {:.3} {:.3}", c.world, gbs(f, ag_q), gbs(f, ag_t));
        println!("RESULT all_reduce {} {:.3} {:.3}", c.world, gbs(2.0 * f, ar_q), gbs(2.0 * f, ar_t));
        if !lat_q.is_empty() {
            let us = |v: &mut Vec<f64>, p| percentile(v, p) * 1e6;
            println!(
                "RESULT latency {} {:.1} {:.1} {:.1} {:.1}",
                c.world,
                us(&mut lat_q, 0.5),
                us(&mut lat_q, 0.99),
                us(&mut lat_t, 0.5),
                us(&mut lat_t, 0.99)
            );
        }
    }
    Ok(())
}

fn parent(a: &Args) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    println!("collectives between processes on loopback, {} MiB per call, best of {} (after a warm-up)", a.mib, a.reps);
    println!("| op | procs | QUIC bus GB/s | TCP ring bus GB/s | QUIC / TCP |");
    println!("|---|---|---|---|---|");
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
        for c in children {
            let out = c.wait_with_output().map_err(|e| e.to_string())?;
            if !out.status.success() {
                return Err(format!("a rank of world {world} failed"));
            }
            for line in String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.strip_prefix("RESULT ")) {
                let f: Vec<&str> = line.split_whitespace().collect();
                match f[..] {
                    ["latency", w, q50, q99, t50, t99] => latency.push(format!("| {w} | {q50} | {q99} | {t50} | {t99} |")),
                    [op, w, qg, tg] => {
                        let (qv, tv): (f64, f64) = (qg.parse().unwrap_or(0.0), tg.parse().unwrap_or(0.0));
                        println!("| {op} | {w} | {qg} | {tg} | {:.0} % |", 100.0 * qv / tv.max(1e-12));
                    }
                    _ => {}
                }
            }
        }
        let _ = std::fs::remove_dir_all(&certs);
    }
    println!("\nsmall messages ({PING_BYTES} B, one way = half a round trip, {PINGS} round trips between ranks 0 and 1), µs:");
    println!("| procs | QUIC p50 | QUIC p99 | TCP p50 | TCP p99 |");
    println!("|---|---|---|---|---|");
    latency.iter().for_each(|l| println!("{l}"));
    Ok(())
}

fn main() -> ExitCode {
    let result = parse().and_then(|a| match &a.child {
        Some(c) => child(c, a.mib, a.reps),
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
