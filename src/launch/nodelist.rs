//! Slurm's compressed host lists (`SLURM_NODELIST`, `SLURM_STEP_NODELIST`): `node[01-03,07],gpu5`
//! names node01, node02, node03, node07 and gpu5. A name may hold several bracket groups
//! (`rack[1-2]-n[1-2]` is rack1-n1, rack1-n2, rack2-n1, rack2-n2, in that order, as Slurm's
//! `scontrol show hostnames` lists them); a range keeps its zero padding (`[08-10]`: 08, 09, 10).

use thiserror::Error;

/// The most hosts a list is expanded to: a bound on typos such as `node[0-999999999]`, far above
/// any cluster's node count.
pub const HOSTS_MAX: usize = 1 << 20;

/// A host list that is not Slurm's syntax.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("host list {list:?}: {what} (expected Slurm's form, e.g. node[01-03,07],gpu5)")]
pub struct NodelistError {
    pub list: String,
    pub what: String,
}

/// One bracket group's values, as written (padding kept).
type Group = Vec<String>;

/// A host name pattern: literal text and bracket groups, alternating.
#[derive(Debug)]
enum Part {
    Text(String),
    Group(Group),
}

/// The hosts of `list`, in Slurm's order, at most [`HOSTS_MAX`].
pub fn expand(list: &str) -> Result<Vec<String>, NodelistError> {
    let err = |what: String| NodelistError { list: list.to_string(), what };
    let mut hosts = Vec::new();
    for item in split_top(list).map_err(err)? {
        let parts = parse_item(&item).map_err(err)?;
        let count = parts.iter().try_fold(1usize, |n, p| match p {
            Part::Group(g) => n.checked_mul(g.len()),
            Part::Text(_) => Some(n),
        });
        if count.is_none_or(|c| c > HOSTS_MAX - hosts.len()) {
            return Err(err(format!("more than {HOSTS_MAX} hosts")));
        }
        let mut names = vec![String::new()];
        for p in &parts {
            names = match p {
                Part::Text(t) => names.into_iter().map(|n| n + t).collect(),
                Part::Group(g) => names.iter().flat_map(|n| g.iter().map(move |v| format!("{n}{v}"))).collect(),
            };
        }
        hosts.extend(names);
    }
    if hosts.is_empty() {
        return Err(err("no hosts".into()));
    }
    Ok(hosts)
}

/// Splits at the commas outside brackets.
fn split_top(list: &str) -> Result<Vec<String>, String> {
    let (mut items, mut cur, mut depth) = (Vec::new(), String::new(), 0u32);
    for c in list.trim().chars() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("nested '['".into()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("']' without '['".into()),
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if depth != 0 {
        return Err("'[' without ']'".into());
    }
    items.push(cur);
    match items.iter().any(|i| i.trim().is_empty()) {
        true => Err("an empty host name".into()),
        false => Ok(items.into_iter().map(|i| i.trim().to_string()).collect()),
    }
}

/// `rack[1-2]-n[1,3]` → Text("rack"), Group(1, 2), Text("-n"), Group(1, 3).
fn parse_item(item: &str) -> Result<Vec<Part>, String> {
    let mut parts = Vec::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        let close = rest[open..].find(']').map(|c| open + c).ok_or("'[' without ']'")?;
        if open > 0 {
            parts.push(Part::Text(rest[..open].to_string()));
        }
        parts.push(Part::Group(parse_group(&rest[open + 1..close])?));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest.to_string()));
    }
    if parts.iter().any(|p| matches!(p, Part::Text(t) if t.chars().any(char::is_whitespace))) {
        return Err(format!("{item:?} holds a space"));
    }
    Ok(parts)
}

/// `01-03,07` → 01, 02, 03, 07.
fn parse_group(g: &str) -> Result<Group, String> {
    let mut values = Vec::new();
    for piece in g.split(',') {
        let piece = piece.trim();
        let (lo, hi) = piece.split_once('-').unwrap_or((piece, piece));
        let num = |s: &str| match s.chars().all(|c| c.is_ascii_digit()) && !s.is_empty() {
            true => s.parse::<u64>().map_err(|_| format!("[{g}]: {s} is too large")),
            false => Err(format!("[{g}]: {piece:?} is not a number or a range A-B")),
        };
        let (a, b) = (num(lo)?, num(hi)?);
        if a > b {
            return Err(format!("[{g}]: the range {piece} runs backwards"));
        }
        if b - a >= HOSTS_MAX as u64 - values.len() as u64 {
            return Err(format!("more than {HOSTS_MAX} hosts"));
        }
        let width = lo.len();
        values.extend((a..=b).map(|v| format!("{v:0width$}")));
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compressed_lists_expand_in_slurms_order_with_padding() {
        assert_eq!(expand("node[01-03,07],gpu5").unwrap(), ["node01", "node02", "node03", "node07", "gpu5"]);
        assert_eq!(expand("n[8-10]").unwrap(), ["n8", "n9", "n10"]);
        assert_eq!(expand("n[08-10]").unwrap(), ["n08", "n09", "n10"]);
        assert_eq!(expand("rack[1-2]-n[1,3]").unwrap(), ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]);
        assert_eq!(expand("solo").unwrap(), ["solo"]);
        assert_eq!(expand(" a , b[2] ").unwrap(), ["a", "b2"]);
        assert_eq!(expand("gpu5,node[01-03]").unwrap()[0], "gpu5");
        assert_eq!(expand("10.0.0.[5-6]").unwrap(), ["10.0.0.5", "10.0.0.6"]);
    }

    #[test]
    fn malformed_lists_are_named() {
        for (list, what) in [
            ("", "empty host name"),
            ("a,,b", "empty host name"),
            ("node[01-03", "'[' without ']'"),
            ("node01-03]", "']' without '['"),
            ("n[[1]]", "nested"),
            ("n[3-1]", "runs backwards"),
            ("n[a-b]", "not a number"),
            ("n[]", "not a number"),
            ("n[1-99999999999999999999]", "too large"),
            ("n[0-999999999]", "more than"),
            ("r[0-9999]-n[0-9999]", "more than"),
        ] {
            let e = expand(list).unwrap_err().to_string();
            assert!(e.contains(what) && e.contains("node[01-03,07]"), "{list:?}: {e}");
        }
    }
}
