//! The rendezvous id a group of ranks meets at.

use super::error::{ensure_library, nccl_err, NcclError};
use cudarc::nccl::sys;

/// The rendezvous id of one communicator (NCCL's 128-byte `ncclUniqueId`): made once by a
/// launcher, passed to every rank. An id serves **one** communicator: a new group (also after
/// an abort) needs a new id (joining twice with one id fails in `ncclCommInitRank` with
/// `ncclRemoteError`, connection refused).
#[derive(Clone, Copy)]
pub struct NcclId(cudarc::nccl::Id);

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`; it also opens the bootstrap socket the ranks will meet at,
    /// so make it on the launcher's or rank 0's host).
    pub fn new() -> Result<NcclId, NcclError> {
        ensure_library()?;
        cudarc::nccl::Id::new().map(NcclId).map_err(|e| nccl_err("ncclGetUniqueId", 0, e.0, std::ptr::null_mut()))
    }

    /// The 128 bytes as 256 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.internal().iter().map(|&c| format!("{:02x}", c as u8)).collect()
    }

    /// Parses [`NcclId::to_hex`]'s output (surrounding whitespace is ignored).
    pub fn from_hex(s: &str) -> Result<NcclId, NcclError> {
        let s = s.trim();
        let bad = |detail: String| Err(NcclError::Invalid { op: "NcclId::from_hex", detail });
        if s.len() != 256 {
            return bad(format!("an NCCL id is 256 hex digits (128 bytes), got {} characters", s.len()));
        }
        let mut raw = [0 as std::ffi::c_char; 128];
        for (i, out) in raw.iter_mut().enumerate() {
            let pair = &s[2 * i..2 * i + 2];
            match u8::from_str_radix(pair, 16) {
                Ok(b) => *out = b as std::ffi::c_char,
                Err(_) => return bad(format!("`{pair}` at position {} is not a hex byte", 2 * i)),
            }
        }
        Ok(NcclId(cudarc::nccl::Id::uninit(raw)))
    }

    pub(super) fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId { internal: *self.0.internal() }
    }
}

impl PartialEq for NcclId {
    fn eq(&self, other: &Self) -> bool {
        self.0.internal() == other.0.internal()
    }
}

impl Eq for NcclId {}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_through_hex() {
        let mut raw = [0 as std::ffi::c_char; 128];
        raw.iter_mut().enumerate().for_each(|(i, c)| *c = (i as u8).wrapping_mul(37) as std::ffi::c_char);
        let id = NcclId(cudarc::nccl::Id::uninit(raw));
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert_eq!(NcclId::from_hex(&format!(" {hex}\n")).unwrap(), id);
        assert!(NcclId::from_hex(&hex[..254]).unwrap_err().to_string().contains("256 hex digits"));
        let bad = format!("zz{}", &hex[2..]);
        assert!(NcclId::from_hex(&bad).unwrap_err().to_string().contains("`zz` at position 0"));
    }
}
