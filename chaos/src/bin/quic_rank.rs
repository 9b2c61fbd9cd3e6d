//! One rank of a QUIC collective exercise, for tests across processes and network namespaces:
//! binds its address, connects to its peers with mTLS, runs a fixed sequence of collectives and
//! prints a fingerprint of the results (the same on every rank and as the in-process backend).
//!
//! `quic_rank RANK CERT_DIR ADDR0,ADDR1,... [TIMEOUT_MS]`

use std::net::SocketAddr;
use std::process::ExitCode;

use tessera_chaos::exercise::{fingerprint, run_exercise};
use tessera_transport::collective::Collective;
use tessera_transport::quic::{ClusterSpec, NodeTls, QuicComm};

fn run(args: &[String]) -> Result<String, String> {
    let [rank, dir, addrs, rest @ ..] = args else {
        return Err("usage: quic_rank RANK CERT_DIR ADDR0,ADDR1,... [TIMEOUT_MS]".into());
    };
    let rank: usize = rank.parse().map_err(|e| format!("RANK `{rank}`: {e}"))?;
    let addrs: Vec<SocketAddr> =
        addrs.split(',').map(|a| a.parse().map_err(|e| format!("address `{a}`: {e}"))).collect::<Result<_, _>>()?;
    let timeout_ms: u64 = rest.first().map_or(Ok(20_000), |t| t.parse().map_err(|e| format!("TIMEOUT_MS `{t}`: {e}")))?;
    let names: Vec<String> = (0..addrs.len()).map(|r| format!("rank{r}")).collect();
    let tls = NodeTls::load(std::path::Path::new(dir), &names[rank]).map_err(|e| e.to_string())?;
    let spec = ClusterSpec { addrs, names };
    let mut comm = QuicComm::connect(rank, &spec, &tls, timeout_ms).map_err(|e| e.to_string())?;
    comm.set_timeout_ms(timeout_ms);
    let results = run_exercise(&mut comm).map_err(|e| e.to_string())?;
    Ok(fingerprint(&results))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(fp) => {
            println!("fingerprint {fp}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("quic_rank: {e}");
            ExitCode::FAILURE
        }
    }
}
