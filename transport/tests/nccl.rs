//! The NCCL backend on two GPUs of one machine (one thread per GPU, as one process per GPU would
//! run): device operations against host-computed sums (2-rank sums are one exact f32 add), the
//! `Collective` implementation against the in-process backend bit for bit, and bounded waits.
//! Without 2 GPUs and libnccl the GPU tests print `skipped: <reason>` and pass.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_kernels::cuda::{bf16, device_count, Gpu};
use tessera_kernels::tensor::Rng;
use tessera_transport::collective::{even_ranges, Collective, CollectiveError};
use tessera_transport::local::LocalGroup;
use tessera_transport::nccl::{NcclComm, NcclError, NcclId, LIBRARY_MISSING};

const LONG: Duration = Duration::from_secs(60);

/// GPU tests share the two GPUs: one at a time.
static GPUS: Mutex<()> = Mutex::new(());

/// An id for a 2-GPU group, or why the GPU tests cannot run here.
fn two_gpus() -> Option<NcclId> {
    match device_count() {
        Err(e) => {
            println!("skipped: {e}");
            return None;
        }
        Ok(n) if n < 2 => {
            println!("skipped: {n} GPU(s) here, 2 needed");
            return None;
        }
        Ok(_) => {}
    }
    match NcclId::new() {
        Ok(id) => Some(id),
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

/// Runs `f` on ranks 0 and 1, each on its own thread and GPU; the id travels as hex, as it would
/// to worker processes.
fn on_two<T: Send>(id: NcclId, f: impl Fn(NcclComm) -> T + Sync) -> Vec<T> {
    let hex = id.to_hex();
    std::thread::scope(|s| {
        let (f, hex) = (&f, &hex);
        let threads: Vec<_> = (0..2)
            .map(|rank| {
                s.spawn(move || {
                    let gpu = Gpu::open(rank).unwrap_or_else(|e| panic!("opening GPU {rank}: {e}"));
                    let id = NcclId::from_hex(hex).expect("hex id");
                    let comm = NcclComm::new(gpu, rank, 2, &id).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    assert_eq!((comm.rank(), comm.world()), (rank, 2));
                    f(comm)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().expect("rank thread panicked")).collect()
    })
}

fn data(seed: u64, who: usize, len: usize) -> Vec<f32> {
    let mut rng = Rng::derive(seed, &[who as u64]);
    (0..len).map(|_| rng.normal() * 10f32.powi(rng.gen_range(7) as i32 - 3)).collect()
}

/// `None` when the bits agree, else where and how they differ.
fn diff<T: Copy + PartialEq + std::fmt::Debug>(name: &str, got: &[T], want: &[T]) -> Option<String> {
    if got.len() != want.len() {
        return Some(format!("{name}: {} elements, {} expected", got.len(), want.len()));
    }
    let bad: Vec<usize> = (0..got.len()).filter(|&i| got[i] != want[i]).collect();
    let &first = bad.first()?;
    Some(format!("{name}: {} of {} elements differ; first at {first}: got {:?}, want {:?}", bad.len(), got.len(), got[first], want[first]))
}

fn bits32(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn nccl_id_without_the_library_is_a_clear_error() {
    match NcclId::new() {
        Ok(id) => println!("libnccl is present (made {id:?}): nothing to check"),
        Err(e) => {
            assert!(matches!(e, NcclError::Library), "{e:?}");
            let msg = e.to_string();
            assert!(msg.starts_with(LIBRARY_MISSING), "{msg}");
            assert!(msg.contains("LD_LIBRARY_PATH") && msg.contains("docs/GPU.md"), "{msg}");
            println!("without libnccl: {msg}");
        }
    }
}

#[test]
fn nccl_ids_parse_only_hex_of_the_right_length() {
    let hex: String = (0..128).map(|i| format!("{:02x}", (i * 37 + 5) % 256)).collect();
    let id = NcclId::from_hex(&hex).unwrap();
    assert_eq!(id.to_hex(), hex);
    assert_eq!(NcclId::from_hex(&hex.to_uppercase()).unwrap(), id);
    for bad in [&hex[..255], "", &format!("{hex}00"), &format!("g{}", &hex[1..])] {
        let err = NcclId::from_hex(bad).unwrap_err();
        assert!(matches!(err, NcclError::Invalid { op: "NcclId::from_hex", .. }), "{err}");
    }
}

/// Device collectives against host sums: with 2 ranks every sum is one f32 (f64) add, exact.
#[test]
fn device_operations_match_host_sums_exactly() {
    let _one_at_a_time = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let Some(id) = two_gpus() else { return };
    let k = 1003;
    let x: Vec<Vec<f32>> = (0..2).map(|r| data(1, r, 2 * k)).collect();
    let y: Vec<Vec<f64>> = x.iter().map(|v| v.iter().map(|&a| f64::from(a) * 1.1).collect()).collect();
    let problems = on_two(id, |comm| {
        let (rank, gpu) = (comm.rank(), comm.gpu().clone());
        let stream = gpu.stream.clone();
        let mut problems = Vec::new();
        let mut check =
            |name: &str, got: &[f32], want: &[f32]| problems.extend(diff(&format!("rank {rank} {name}"), &bits32(got), &bits32(want)));
        let run = |what: &str, r: Result<(), NcclError>| {
            r.and_then(|()| comm.wait(&stream, LONG)).unwrap_or_else(|e| panic!("rank {rank} {what}: {e}"));
        };
        let mine = gpu.upload(&x[rank]).unwrap();

        let out = gpu.alloc::<f32>(k).unwrap();
        run("reduce_scatter_f32", comm.reduce_scatter_f32(mine.ptr(), out.ptr(), &stream));
        let want: Vec<f32> = (0..k).map(|i| x[0][rank * k + i] + x[1][rank * k + i]).collect();
        check("reduce_scatter_f32", &gpu.download(out.ptr()).unwrap(), &want);

        let full = gpu.alloc::<f32>(2 * k).unwrap();
        run("all_gather_f32", comm.all_gather_f32(mine.slice(0..k), full.ptr(), &stream));
        let want: Vec<f32> = [&x[0][..k], &x[1][..k]].concat();
        check("all_gather_f32", &gpu.download(full.ptr()).unwrap(), &want);

        let to_bf = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a)).collect::<Vec<_>>();
        let shard = gpu.upload(&to_bf(&x[rank][..k])).unwrap();
        let full_bf = gpu.alloc::<bf16>(2 * k).unwrap();
        run("all_gather_bf16", comm.all_gather_bf16(shard.ptr(), full_bf.ptr(), &stream));
        let got: Vec<f32> = gpu.download(full_bf.ptr()).unwrap().iter().map(|b| b.to_f32()).collect();
        let want: Vec<f32> = to_bf(&want).iter().map(|b| b.to_f32()).collect();
        check("all_gather_bf16", &got, &want);

        let sum = gpu.upload(&x[rank]).unwrap();
        run("all_reduce_sum_f32", comm.all_reduce_sum_f32(sum.ptr(), &stream));
        let want: Vec<f32> = (0..2 * k).map(|i| x[0][i] + x[1][i]).collect();
        check("all_reduce_sum_f32", &gpu.download(sum.ptr()).unwrap(), &want);

        let sum64 = gpu.upload(&y[rank]).unwrap();
        run("all_reduce_sum_f64", comm.all_reduce_sum_f64(sum64.ptr(), &stream));
        let got64 = gpu.download(sum64.ptr()).unwrap();
        let want64: Vec<f64> = (0..2 * k).map(|i| y[0][i] + y[1][i]).collect();
        let as_bits = |v: &[f64]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
        problems.extend(diff(&format!("rank {rank} all_reduce_sum_f64"), &as_bits(&got64), &as_bits(&want64)));

        let b = gpu.upload(&x[rank]).unwrap();
        run("broadcast_f32", comm.broadcast_f32(b.ptr(), 1, &stream));
        let got = gpu.download(b.ptr()).unwrap();
        problems.extend(diff(&format!("rank {rank} broadcast_f32"), &bits32(&got), &bits32(&x[1])));

        let recv = gpu.alloc::<f32>(2 * k).unwrap();
        run("all_to_all_f32", comm.all_to_all_f32(mine.ptr(), recv.ptr(), &stream));
        let want: Vec<f32> = [&x[0][rank * k..(rank + 1) * k], &x[1][rank * k..(rank + 1) * k]].concat();
        let got = gpu.download(recv.ptr()).unwrap();
        problems.extend(diff(&format!("rank {rank} all_to_all_f32"), &bits32(&got), &bits32(&want)));

        // Rank 0 sends then receives, rank 1 the other way round: the same order on both.
        let got_p2p = gpu.alloc::<f32>(k).unwrap();
        let peer = 1 - rank;
        if rank == 0 {
            run("send_f32", comm.send_f32(peer, mine.slice(0..k), &stream));
            run("recv_f32", comm.recv_f32(peer, got_p2p.ptr(), &stream));
        } else {
            run("recv_f32", comm.recv_f32(peer, got_p2p.ptr(), &stream));
            run("send_f32", comm.send_f32(peer, mine.slice(0..k), &stream));
        }
        let got = gpu.download(got_p2p.ptr()).unwrap();
        problems.extend(diff(&format!("rank {rank} send/recv"), &bits32(&got), &bits32(&x[peer][..k])));
        problems
    });
    let problems: Vec<String> = problems.into_iter().flatten().collect();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    println!("device reduce_scatter, all_gather (f32, bf16), all_reduce (f32, f64), broadcast, all_to_all, send/recv: exact");
}

/// Ranges with an empty one, a 1-element one and the rest.
fn uneven_ranges(len: usize) -> [Vec<std::ops::Range<usize>>; 3] {
    [even_ranges(len, 2), vec![0..0, 0..len], vec![0..1, 1..len]]
}

/// Every host operation once; all outputs as bits.
fn every_op(c: &mut dyn Collective, len: usize) -> Vec<Vec<u64>> {
    let (rank, world) = (c.rank(), c.world());
    c.set_timeout_ms(60_000);
    let b32 = |x: &[f32]| x.iter().map(|v| u64::from(v.to_bits())).collect::<Vec<_>>();
    let mine = data(3, rank, len);
    let mut out = Vec::new();
    let mut buf = mine.clone();
    c.all_reduce_sum(&mut buf).unwrap();
    out.push(b32(&buf));
    let mut buf64: Vec<f64> = mine.iter().map(|&v| f64::from(v) * 1.1).collect();
    c.all_reduce_sum_f64(&mut buf64).unwrap();
    out.push(buf64.iter().map(|v| v.to_bits()).collect());
    for ranges in uneven_ranges(len) {
        let mut part = vec![0.0; ranges[rank].len()];
        c.reduce_scatter_sum(&mine, &ranges, &mut part).unwrap();
        out.push(b32(&part));
        let mut full = vec![0.0; len];
        c.all_gather(&mine[ranges[rank].clone()], &ranges, &mut full).unwrap();
        out.push(b32(&full));
        let mut slices = vec![Vec::new(); world];
        c.gather_slices(&mine, &ranges, &mut slices).unwrap();
        out.extend(slices.iter().map(|s| b32(s)));
    }
    for root in 0..world {
        let mut b = mine.clone();
        c.broadcast(&mut b, root).unwrap();
        out.push(b32(&b));
    }
    let sends: Vec<Vec<f32>> = (0..world).map(|j| data(4, rank * 10 + j, 3 * j + rank)).collect();
    let got = c.all_to_all(&sends.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
    out.extend(got.iter().map(|r| b32(r)));
    // Point to point, one direction at a time (NCCL's sends are rendezvous); tags out of order.
    let peer = 1 - rank;
    for sender in 0..2 {
        if rank == sender {
            c.send(peer, 2, &[rank as f32, 2.0]).unwrap();
            c.send(peer, 1, &mine[..len.min(7)]).unwrap();
            c.send(peer, 1, &[]).unwrap();
        } else {
            out.push(b32(&c.recv(peer, 1).unwrap()));
            out.push(b32(&c.recv(peer, 1).unwrap()));
            out.push(b32(&c.recv(peer, 2).unwrap()));
        }
    }
    c.send(rank, 9, &[42.0]).unwrap();
    out.push(b32(&c.recv(rank, 9).unwrap()));
    c.barrier().unwrap();
    let s = c.stats();
    out.push(vec![s.bytes_sent, s.bytes_received, s.ops]);
    out
}

#[test]
fn collective_impl_matches_the_local_backend_bit_for_bit() {
    let _one_at_a_time = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let Some(first) = two_gpus() else { return };
    for (i, len) in [1, 37, 100_003].into_iter().enumerate() {
        // An id serves one communicator.
        let id = if i == 0 { first } else { NcclId::new().unwrap() };
        let want: Vec<Vec<Vec<u64>>> = std::thread::scope(|s| {
            let threads: Vec<_> = LocalGroup::new(2).into_iter().map(|mut c| s.spawn(move || every_op(&mut c, len))).collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let got = on_two(id, |mut c| every_op(&mut c, len));
        for rank in 0..2 {
            assert_eq!(got[rank].len(), want[rank].len(), "len {len} rank {rank}: number of outputs");
            let problems: Vec<String> = got[rank]
                .iter()
                .zip(&want[rank])
                .enumerate()
                .filter_map(|(i, (g, w))| diff(&format!("len {len} rank {rank} output {i}"), g, w))
                .collect();
            assert!(problems.is_empty(), "{}", problems.join("\n"));
        }
    }
    println!("Collective over NCCL = LocalGroup bit for bit (outputs and CommStats)");
}

#[test]
fn disagreements_are_reported_on_both_ranks_and_the_group_goes_on() {
    let _one_at_a_time = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let Some(id) = two_gpus() else { return };
    let results = on_two(id, |mut c| {
        c.set_timeout_ms(60_000);
        let rank = c.rank();
        let mut got = Vec::new();
        got.push(c.all_reduce_sum(&mut vec![1.0; 4 + rank]));
        got.push(if rank == 0 { c.barrier() } else { c.broadcast(&mut [1.0], 0) });
        let ranges = if rank == 1 { vec![0..1, 1..4] } else { vec![0..2, 2..4] };
        got.push(c.reduce_scatter_sum(&[1.0; 4], &ranges, &mut vec![0.0; ranges[rank].len()]));
        got.push(c.broadcast(&mut [1.0], rank));
        got.push(c.all_to_all(&vec![&[1.0f32][..]; 2 + rank]).map(|_| ()));
        let invalid = c.broadcast(&mut [1.0], 2);
        let mut buf = [rank as f32 + 1.0];
        c.all_reduce_sum(&mut buf).unwrap();
        (got, invalid, buf[0])
    });
    for (rank, (got, invalid, sum)) in results.iter().enumerate() {
        assert!(got.iter().all(|r| matches!(r, Err(CollectiveError::Mismatch { .. }))), "rank {rank}: {got:?}");
        assert!(matches!(invalid, Err(CollectiveError::InvalidArgument { .. })), "rank {rank}: {invalid:?}");
        assert_eq!(*sum, 3.0);
    }
    let detail = results[0].0[1].as_ref().unwrap_err().to_string();
    assert!(detail.contains("rank 1 called broadcast but rank 0 called barrier"), "{detail}");
}

#[test]
fn a_collective_whose_peer_never_joins_times_out_and_aborts() {
    let _one_at_a_time = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let Some(id) = two_gpus() else { return };
    let start = Instant::now();
    let (tx, rx) = mpsc::channel::<()>();
    let (tx, rx) = (Mutex::new(Some(tx)), Mutex::new(Some(rx)));
    let results = on_two(id, |mut comm| {
        let (rank, gpu) = (comm.rank(), comm.gpu().clone());
        let stream = gpu.stream.clone();
        let buf = gpu.alloc::<f32>(4096).unwrap();
        // Both run it once, so the connections this all-reduce needs exist.
        comm.all_reduce_sum_f32(buf.ptr(), &stream).unwrap();
        comm.wait(&stream, LONG).unwrap();
        if rank == 0 {
            comm.all_reduce_sum_f32(buf.ptr(), &stream).unwrap();
            let timed_out = comm.wait(&stream, Duration::from_millis(1));
            let aborted = comm.is_aborted();
            let later = comm.all_reduce_sum_f32(buf.ptr(), &stream);
            let host = comm.barrier();
            drop(tx.lock().unwrap().take());
            (format!("{timed_out:?}"), aborted, format!("{later:?}"), format!("{host:?}"))
        } else {
            // Rank 1 never joins; once rank 0 has given up, it aborts its side as a supervisor would.
            let rx = rx.lock().unwrap().take().unwrap();
            let _ = rx.recv_timeout(LONG);
            comm.abort();
            let later = comm.wait(&stream, Duration::from_millis(1));
            (String::new(), comm.is_aborted(), format!("{later:?}"), String::new())
        }
    });
    let (timed_out, aborted, later, host) = &results[0];
    assert!(timed_out.starts_with("Err(Timeout { op: \"all_reduce_sum_f32\", rank: 0"), "{timed_out}");
    assert!(*aborted && results[1].1);
    assert!(later.starts_with("Err(Aborted { op: \"all_reduce_sum_f32\", rank: 0"), "{later}");
    assert!(host.starts_with("Err(Aborted { op: \"barrier\""), "{host}");
    assert!(results[1].2.starts_with("Ok(())") || results[1].2.starts_with("Err(Aborted"), "{}", results[1].2);
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
    println!("1 ms wait on a collective without its peer: {timed_out}; both ranks finished in {:?}", start.elapsed());
}

#[test]
fn an_abort_handle_stops_a_waiting_rank() {
    let _one_at_a_time = GPUS.lock().unwrap_or_else(|p| p.into_inner());
    let Some(id) = two_gpus() else { return };
    let stopped = Arc::new(Mutex::new(None));
    let results = on_two(id, |mut comm| {
        comm.set_timeout_ms(60_000);
        let start = Instant::now();
        if comm.rank() == 0 {
            let handle = comm.abort_handle();
            let aborter = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                handle.abort("rank 1 died");
            });
            let r = comm.barrier();
            aborter.join().unwrap();
            *stopped.lock().unwrap() = Some(());
            (r, start.elapsed())
        } else {
            while stopped.lock().unwrap().is_none() && start.elapsed() < LONG {
                std::thread::sleep(Duration::from_millis(5));
            }
            comm.abort();
            (comm.barrier(), start.elapsed())
        }
    });
    match &results[0].0 {
        Err(CollectiveError::Aborted { op: "barrier", reason }) => assert_eq!(reason, "rank 1 died"),
        other => panic!("rank 0 got {other:?}"),
    }
    assert!(results[0].1 < Duration::from_secs(30), "rank 0 waited {:?}", results[0].1);
    assert!(matches!(results[1].0, Err(CollectiveError::Aborted { .. })), "{:?}", results[1].0);
}
