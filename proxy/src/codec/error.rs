//! Typed errors of the codec. None of them is fatal to the process: the caller decides
//! whether to close one connection (framing) or to relay a frame untouched (body).

use thiserror::Error;

/// A frame header that cannot be the start of a coro_rpc frame. The master closes the
/// connection without a reply for each of these; so does moongate.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("bad magic byte {0:#04x} (coro_rpc frames start with 0x15)")]
    BadMagic(u8),
    #[error("unsupported coro_rpc version {0} (only 0 exists)")]
    UnsupportedVersion(u8),
    #[error("unsupported serialize type {0} (only 0 = struct_pack exists)")]
    UnsupportedSerializeType(u8),
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: u64, max: u64 },
}

/// A struct_pack body that does not decode as the expected type.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("body truncated at byte {at}: need {need} bytes, {have} left")]
    Truncated { at: usize, need: usize, have: usize },
    #[error("length {len} at byte {at} exceeds the {have} bytes left")]
    LengthTooLarge { at: usize, len: u64, have: usize },
    #[error("type code {found:#010x} is not the expected {expected:#010x}")]
    TypeMismatch { expected: u32, found: u32 },
    #[error("type literal differs from the expected type's literal")]
    LiteralMismatch,
    #[error("metainfo byte {0:#04x} uses features Mooncake never sends (compatible section)")]
    UnsupportedMetainfo(u8),
    #[error("type literal has no NUL terminator")]
    UnterminatedLiteral,
    #[error("body carries no type literal, so it cannot be decoded without a schema")]
    MissingLiteral,
    #[error("bad type literal at byte {at}: {reason}")]
    BadLiteral { at: usize, reason: &'static str },
    #[error("flag byte at {at} is {value}, not 0 or 1")]
    BadFlag { at: usize, value: u8 },
    #[error("variant index {index} at byte {at} has no alternative")]
    BadVariant { at: usize, index: u8 },
    #[error("{0} bytes left over after the value")]
    TrailingBytes(usize),
    #[error("values nest deeper than {0} levels")]
    TooDeep(usize),
}
