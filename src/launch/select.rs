//! DeepSpeed's launcher selection on a hostfile: `--include`/`--exclude` (`host1:0,1@host2`),
//! `--num_nodes` and `--num_gpus`, with the meaning DeepSpeed's runner gives them. A hostfile
//! line `HOST slots=N` offers slots 0..N on HOST;
//!
//! - `--include SPEC` keeps only what SPEC names: `HOST` (all its slots) or `HOST:S,T` (those
//!   slots), several joined by `@`;
//! - `--exclude SPEC` removes what SPEC names (a host named without slots goes whole; a host
//!   left without slots goes too);
//! - `--num_nodes N` then keeps the first N hosts, `--num_gpus N` the first N slots of each.
//!
//! A host or slot that the hostfile does not offer is an error, as are both filters at once. The
//! result keeps the hostfile's order (ranks follow it) with each host's slots in ascending order.
//! Where DeepSpeed's `--num_gpus` would start more processes on a host than its `slots`, Tessera
//! refuses: the hostfile is the capacity (DeepSpeed's local processes would each need a GPU).

use std::collections::BTreeSet;

use anyhow::{bail, Result};

use super::HostEntry;

/// The selection flags of `tessera launch`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    pub include: Option<String>,
    pub exclude: Option<String>,
    pub num_nodes: Option<usize>,
    pub num_gpus: Option<usize>,
}

/// A host with the slots chosen on it (each runs one agent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    pub host: String,
    /// The hostfile line (for messages).
    pub line: usize,
    pub slots: Vec<usize>,
}

/// `HOST[:S,T]@HOST…` as (host, slots named; empty = the whole host).
fn parse_spec(flag: &str, spec: &str) -> Result<Vec<(String, Vec<usize>)>> {
    let mut out: Vec<(String, Vec<usize>)> = Vec::new();
    for node in spec.split('@') {
        let node = node.trim();
        let (host, slots) = match node.split_once(':') {
            Some((h, s)) => (h.trim(), Some(s)),
            None => (node, None),
        };
        if host.is_empty() {
            bail!("{flag} {spec:?}: an empty host name (expected HOST or HOST:SLOT,SLOT, joined by @, e.g. worker-0:0,1@worker-1)");
        }
        let mut list = Vec::new();
        if let Some(s) = slots {
            for w in s.split(',') {
                let n = w
                    .trim()
                    .parse::<usize>()
                    .map_err(|_| anyhow::anyhow!("{flag} {spec:?}: slot {w:?} of host {host} is not a whole number"))?;
                list.push(n);
            }
        }
        match out.iter_mut().find(|(h, _)| h == host) {
            // A host named twice: DeepSpeed merges its slots.
            Some((_, prev)) if !prev.is_empty() && !list.is_empty() => prev.extend(list),
            Some((_, prev)) => prev.clear(),
            None => out.push((host.to_string(), list)),
        }
    }
    Ok(out)
}

/// Applies `sel` to the hostfile's `hosts`; `source` names the hostfile in errors.
pub fn select(hosts: &[HostEntry], sel: &Selection, source: &str) -> Result<Vec<Chosen>> {
    let mut chosen: Vec<(usize, BTreeSet<usize>)> = hosts.iter().enumerate().map(|(i, h)| (i, (0..h.slots).collect())).collect();
    let (flag, spec) = match (&sel.include, &sel.exclude) {
        (Some(_), Some(_)) => bail!("--include and --exclude: give one of the two, as DeepSpeed's launcher requires"),
        (Some(s), None) => ("--include", Some(s)),
        (None, Some(s)) => ("--exclude", Some(s)),
        (None, None) => ("", None),
    };
    if let Some(spec) = spec {
        let include = flag == "--include";
        let mut kept: Vec<(usize, BTreeSet<usize>)> = Vec::new();
        for (host, slots) in parse_spec(flag, spec)? {
            let Some(i) = hosts.iter().position(|h| h.host == host) else {
                bail!("{flag} {spec:?}: host {host} is not in {source}");
            };
            if let Some(s) = slots.iter().find(|s| **s >= hosts[i].slots) {
                bail!("{flag} {spec:?}: host {host} has no slot {s} ({source}:{} gives it slots 0..{})", hosts[i].line, hosts[i].slots);
            }
            let named: BTreeSet<usize> = match slots.is_empty() {
                true => (0..hosts[i].slots).collect(),
                false => slots.into_iter().collect(),
            };
            match include {
                true => kept.push((i, named)),
                false => chosen[i].1.retain(|s| !named.contains(s)),
            }
        }
        if include {
            kept.sort_by_key(|(i, _)| *i);
            chosen = kept;
        }
        chosen.retain(|(_, s)| !s.is_empty());
    }
    if let Some(n) = sel.num_nodes {
        if n == 0 || n > chosen.len() {
            bail!("--num_nodes {n}: {} host(s) are left to run on (of {source}{})", chosen.len(), described(flag));
        }
        chosen.truncate(n);
    }
    if let Some(n) = sel.num_gpus {
        for (i, slots) in chosen.iter_mut() {
            if n == 0 || n > slots.len() {
                bail!(
                    "--num_gpus {n}: host {} offers {} slot(s) ({source}:{}{})",
                    hosts[*i].host,
                    slots.len(),
                    hosts[*i].line,
                    described(flag)
                );
            }
            *slots = slots.iter().copied().take(n).collect();
        }
    }
    if chosen.is_empty() {
        bail!("{flag} leaves no host of {source} to run on");
    }
    Ok(chosen
        .into_iter()
        .map(|(i, s)| Chosen { host: hosts[i].host.clone(), line: hosts[i].line, slots: s.into_iter().collect() })
        .collect())
}

fn described(flag: &str) -> String {
    match flag {
        "" => String::new(),
        f => format!(", after {f}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts() -> Vec<HostEntry> {
        super::super::parse_hostfile("worker-0 slots=4\nworker-1 slots=4\nworker-2 slots=2\n", "hf").unwrap()
    }

    fn sel(include: Option<&str>, exclude: Option<&str>, nodes: Option<usize>, gpus: Option<usize>) -> Selection {
        Selection { include: include.map(String::from), exclude: exclude.map(String::from), num_nodes: nodes, num_gpus: gpus }
    }

    fn picked(s: &Selection) -> Vec<(String, Vec<usize>)> {
        select(&hosts(), s, "hf").unwrap().into_iter().map(|c| (c.host, c.slots)).collect()
    }

    fn h(host: &str, slots: &[usize]) -> (String, Vec<usize>) {
        (host.to_string(), slots.to_vec())
    }

    #[test]
    fn include_exclude_num_nodes_and_num_gpus_select_as_deepspeed() {
        let all = vec![h("worker-0", &[0, 1, 2, 3]), h("worker-1", &[0, 1, 2, 3]), h("worker-2", &[0, 1])];
        assert_eq!(picked(&Selection::default()), all);
        // Include keeps the hostfile's order, whatever the spec's.
        assert_eq!(picked(&sel(Some("worker-2@worker-0:1,3"), None, None, None)), vec![h("worker-0", &[1, 3]), h("worker-2", &[0, 1])]);
        assert_eq!(picked(&sel(Some("worker-1:2,0"), None, None, None)), vec![h("worker-1", &[0, 2])]);
        assert_eq!(picked(&sel(None, Some("worker-1@worker-0:0"), None, None)), vec![h("worker-0", &[1, 2, 3]), h("worker-2", &[0, 1])]);
        // A host whose every slot is excluded goes.
        assert_eq!(picked(&sel(None, Some("worker-2:0,1"), None, None)), all[..2].to_vec());
        assert_eq!(picked(&sel(None, None, Some(2), None)), all[..2].to_vec());
        assert_eq!(picked(&sel(None, None, None, Some(2))), vec![h("worker-0", &[0, 1]), h("worker-1", &[0, 1]), h("worker-2", &[0, 1])]);
        // The counts apply after the filter: the first N slots left.
        assert_eq!(picked(&sel(None, Some("worker-0:0"), Some(1), Some(2))), vec![h("worker-0", &[1, 2])]);
    }

    #[test]
    fn selections_the_hostfile_cannot_give_are_refused() {
        for (s, what) in [
            (sel(Some("a"), Some("b"), None, None), "give one of the two"),
            (sel(Some("worker-9"), None, None, None), "host worker-9 is not in hf"),
            (sel(Some("worker-2:2"), None, None, None), "host worker-2 has no slot 2 (hf:3 gives it slots 0..2)"),
            (sel(Some("worker-0:x"), None, None, None), "slot \"x\" of host worker-0"),
            (sel(Some("@worker-0"), None, None, None), "an empty host name"),
            (sel(None, Some("worker-0@worker-1@worker-2"), None, None), "leaves no host"),
            (sel(None, None, Some(4), None), "--num_nodes 4: 3 host(s)"),
            (sel(None, None, Some(0), None), "--num_nodes 0"),
            (sel(None, None, None, Some(3)), "--num_gpus 3: host worker-2 offers 2 slot(s) (hf:3)"),
            (sel(None, Some("worker-0:0,1,2"), None, Some(2)), "host worker-0 offers 1 slot(s) (hf:1, after --exclude)"),
        ] {
            let e = select(&hosts(), &s, "hf").unwrap_err().to_string();
            assert!(e.contains(what), "{s:?}: {e}");
        }
    }
}
