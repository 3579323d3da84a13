//! vLLM's KV-event wire format: a msgpack `KVEventBatch` as `vllm/distributed/kv_events.py`
//! declares it with msgspec (`array_like=True`, `tag=True`, `omit_defaults=True`):
//!
//! ```text
//! batch   = [ts: float64, [event, ...]]             (data_parallel_rank omitted)
//! event   = ["BlockStored", [hash, ...], parent | nil, [token_id, ...], block_size,
//!            lora_id | nil, medium | nil]
//!         | ["BlockRemoved", [hash, ...], medium | nil]
//!         | ["AllBlocksCleared"]
//! message = [topic, seq as 8 bytes big-endian, batch]  (ZeroMQ multipart)
//! ```
//!
//! In a `BlockStored`, `block_hashes` is one chain: block i's parent is block i-1, and
//! `parent_block_hash` is the parent of the first. Pure: values in, bytes out.

use rmp::encode as mp;

/// One KV event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        medium: Option<&'static str>,
    },
    Removed {
        hashes: Vec<u64>,
        medium: Option<&'static str>,
    },
    Cleared,
}

impl Event {
    /// The event's type name on the wire (its msgspec tag), also a metric label.
    pub fn tag(&self) -> &'static str {
        super::metrics::EVENT_TYPES[self.index()]
    }

    /// Its place in [`super::metrics::EVENT_TYPES`].
    pub fn index(&self) -> usize {
        match self {
            Event::Stored { .. } => 0,
            Event::Removed { .. } => 1,
            Event::Cleared => 2,
        }
    }
}

/// The sequence number frame: 8 bytes, big-endian, as vLLM's subscribers read it.
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// The replay stream's end marker: -1 as a signed 8-byte big-endian integer.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Encodes one batch (`ts`: seconds since the Unix epoch). `block_tokens`: the
/// `block_size` field (tokens per block); token ids are not known to moongate and go as
/// an empty list.
pub fn encode_batch(ts: f64, events: &[Event], block_tokens: u64, out: &mut Vec<u8>) {
    // Writing into a Vec cannot fail: the results carry no information.
    let _ = mp::write_array_len(out, 2);
    let _ = mp::write_f64(out, ts);
    let _ = mp::write_array_len(out, events.len() as u32);
    for e in events {
        match e {
            Event::Stored {
                hashes,
                parent,
                medium,
            } => {
                let _ = mp::write_array_len(out, 7);
                let _ = mp::write_str(out, e.tag());
                write_hashes(out, hashes);
                match parent {
                    Some(p) => {
                        let _ = mp::write_uint(out, *p);
                    }
                    None => {
                        let _ = mp::write_nil(out);
                    }
                }
                let _ = mp::write_array_len(out, 0);
                let _ = mp::write_uint(out, block_tokens);
                let _ = mp::write_nil(out);
                write_medium(out, *medium);
            }
            Event::Removed { hashes, medium } => {
                let _ = mp::write_array_len(out, 3);
                let _ = mp::write_str(out, e.tag());
                write_hashes(out, hashes);
                write_medium(out, *medium);
            }
            Event::Cleared => {
                let _ = mp::write_array_len(out, 1);
                let _ = mp::write_str(out, e.tag());
            }
        }
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[u64]) {
    let _ = mp::write_array_len(out, hashes.len() as u32);
    for h in hashes {
        let _ = mp::write_uint(out, *h);
    }
}

fn write_medium(out: &mut Vec<u8>, medium: Option<&str>) {
    match medium {
        Some(m) => {
            let _ = mp::write_str(out, m);
        }
        None => {
            let _ = mp::write_nil(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes worked out by hand from the msgpack spec, so the encoder is checked against
    /// the format, not against itself.
    #[test]
    fn a_batch_of_each_event_is_vllms_msgpack() {
        let mut out = Vec::new();
        encode_batch(
            1.5,
            &[
                Event::Stored {
                    hashes: vec![1, 300],
                    parent: None,
                    medium: Some("MEMORY"),
                },
                Event::Removed {
                    hashes: vec![7],
                    medium: None,
                },
                Event::Cleared,
            ],
            16,
            &mut out,
        );
        let mut want = vec![0x92, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93);
        // ["BlockStored", [1, 300], nil, [], 16, nil, "MEMORY"]
        want.extend_from_slice(&[0x97, 0xab]);
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[0x92, 0x01, 0xcd, 0x01, 0x2c, 0xc0, 0x90, 0x10, 0xc0, 0xa6]);
        want.extend_from_slice(b"MEMORY");
        // ["BlockRemoved", [7], nil]
        want.extend_from_slice(&[0x93, 0xac]);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x91, 0x07, 0xc0]);
        // ["AllBlocksCleared"]
        want.extend_from_slice(&[0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        assert_eq!(out, want);
    }

    #[test]
    fn parents_and_large_hashes_are_unsigned_ints() {
        let mut out = Vec::new();
        encode_batch(
            0.0,
            &[Event::Stored {
                hashes: vec![u64::MAX],
                parent: Some(5),
                medium: None,
            }],
            0,
            &mut out,
        );
        let tail = &out[out.len() - 15..];
        // [u64::MAX] as uint64, parent 5, [], 0, nil, nil
        assert_eq!(tail[..3], [0x91, 0xcf, 0xff]);
        assert_eq!(tail[10..], [0x05, 0x90, 0x00, 0xc0, 0xc0][..]);
        assert_eq!(seq_frame(258), [0, 0, 0, 0, 0, 0, 1, 2]);
        assert_eq!(END_SEQ, [0xff; 8]);
    }
}
