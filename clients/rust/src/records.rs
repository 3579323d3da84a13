//! The binary records of the kv face's batch calls (`application/x-moongate-records`),
//! the one definition both sides use: this client writes put records and reads get
//! answers; moongate (`proxy/src/kv/api/records.rs`) reads the first and writes the
//! second with these same functions.
//!
//! All integers are little-endian.
//! - A batch put body is a sequence of `u16 key_len | key | u64 value_len | value`.
//! - A batch get answer is a sequence of `u16 status | u64 len | payload`, one per asked
//!   key in order: the value when `status` is 200, else `{"error": "..."}`.

/// Content type of both record streams.
pub const CONTENT_TYPE: &str = "application/x-moongate-records";

/// Bytes before a put record's key (its length).
pub const KEY_HEAD: usize = 2;
/// Bytes of a length before a put record's value or a get record's payload.
pub const LEN_HEAD: usize = 8;
/// Bytes before a get record's payload (status and length).
pub const GET_HEAD: usize = 2 + LEN_HEAD;

/// Appends one put record; `None` for a key longer than a record can name.
pub fn put_record(out: &mut Vec<u8>, key: &[u8], value: &[u8]) -> Option<()> {
    let klen = u16::try_from(key.len()).ok()?;
    out.reserve(KEY_HEAD + key.len() + LEN_HEAD + value.len());
    out.extend_from_slice(&klen.to_le_bytes());
    out.extend_from_slice(key);
    out.extend_from_slice(&(value.len() as u64).to_le_bytes());
    out.extend_from_slice(value);
    Some(())
}

/// The head of one get record.
pub fn get_head(status: u16, len: u64) -> [u8; GET_HEAD] {
    let mut h = [0u8; GET_HEAD];
    h[..2].copy_from_slice(&status.to_le_bytes());
    h[2..].copy_from_slice(&len.to_le_bytes());
    h
}

/// A put record's key length, from its first [`KEY_HEAD`] bytes.
pub fn key_len(head: [u8; KEY_HEAD]) -> usize {
    u16::from_le_bytes(head) as usize
}

/// A length field ([`LEN_HEAD`] bytes).
pub fn len(head: [u8; LEN_HEAD]) -> u64 {
    u64::from_le_bytes(head)
}

/// Splits a whole get answer into `(status, payload)` records; `None` when it is not a
/// sequence of whole records.
pub fn parse_get_answer(mut b: &[u8]) -> Option<Vec<(u16, &[u8])>> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let head = b.get(..GET_HEAD)?;
        let status = u16::from_le_bytes([head[0], head[1]]);
        let n = usize::try_from(len(head[2..].try_into().ok()?)).ok()?;
        let payload = b.get(GET_HEAD..GET_HEAD.checked_add(n)?)?;
        out.push((status, payload));
        b = &b[GET_HEAD + n..];
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_cut_ones_are_refused() {
        let mut put = Vec::new();
        put_record(&mut put, b"k", b"v").unwrap();
        assert_eq!(put, [1, 0, b'k', 1, 0, 0, 0, 0, 0, 0, 0, b'v']);
        assert!(put_record(&mut put, &[0u8; 70_000], b"").is_none());
        let mut get = get_head(200, 2).to_vec();
        get.extend_from_slice(b"ab");
        get.extend_from_slice(&get_head(404, 0));
        assert_eq!(
            parse_get_answer(&get).unwrap(),
            [(200, &b"ab"[..]), (404, &b""[..])]
        );
        assert!(parse_get_answer(&get[..11]).is_none());
        assert!(parse_get_answer(&get_head(200, u64::MAX)).is_none());
    }
}
