//! A fixed sequence of collectives whose results must not depend on the backend or the network:
//! used by fault tests in one process and across processes and namespaces.

use tessera_transport::collective::{even_ranges, Collective, CollectiveError};
use tessera_transport::tree::TreeSum;

/// Elements per rank's input.
pub const EXERCISE_LEN: usize = 50_000;

fn input(rank: usize) -> Vec<f32> {
    (0..EXERCISE_LEN).map(|i| ((i * 7 + rank * 13) % 101) as f32 / 7.0 + rank as f32 * 1e5).collect()
}

/// all_reduce, all_gather and the world-size-independent tree reduction, on one rank.
pub fn run_exercise(comm: &mut dyn Collective) -> Result<Vec<Vec<f32>>, CollectiveError> {
    let (rank, world) = (comm.rank(), comm.world());
    let mut sum = input(rank);
    comm.all_reduce_sum(&mut sum)?;
    let ranges = even_ranges(EXERCISE_LEN, world);
    let mut gathered = vec![0.0; EXERCISE_LEN];
    comm.all_gather(&input(rank)[ranges[rank].clone()], &ranges, &mut gathered)?;
    let mut slices = vec![Vec::new(); world];
    comm.gather_slices(&input(rank), &ranges, &mut slices)?;
    let mut tree = TreeSum::new();
    for (r, s) in slices.into_iter().enumerate() {
        tree.push_block(r, 0, s).map_err(|e| CollectiveError::Mismatch { op: "exercise", detail: e.to_string() })?;
    }
    let mine = tree.finish().unwrap_or_default();
    // Every rank ends with the full tree result, so fingerprints are comparable across ranks.
    let mut full = vec![0.0; EXERCISE_LEN];
    comm.all_gather(&mine, &ranges, &mut full)?;
    Ok(vec![sum, gathered, full])
}

/// FNV-1a over the f32 bits, as hex.
pub fn fingerprint(results: &[Vec<f32>]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for x in results.iter().flatten() {
        for b in x.to_bits().to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}
