//! coro_rpc framing: fixed headers with a body length and an attachment length.
//!
//! Request: 20-byte header (magic, version, serialize type, msg type, seq, function id,
//! length, attach length). Response: 16-byte header (magic, version, err_code, msg type,
//! seq, length, attach length). All integers little-endian.
//!
//! Framing is `check` (is a whole frame buffered? is its header sane?) then `split`
//! (cut it out of the buffer as cheap [`Bytes`] slices). No sockets, no clocks.

use bytes::{BufMut, Bytes, BytesMut};

use super::error::FrameError;

pub const MAGIC: u8 = 21;
pub const REQUEST_HEADER_LEN: usize = 20;
pub const RESPONSE_HEADER_LEN: usize = 16;

/// coro_rpc transport-level error codes carried in a response header's `err_code`.
pub mod errc {
    pub const OK: u8 = 0;
    pub const IO_ERROR: u8 = 1;
    pub const NOT_CONNECTED: u8 = 2;
    pub const TIMED_OUT: u8 = 3;
    pub const INVALID_RPC_ARGUMENTS: u8 = 4;
    pub const RPC_THROW_EXCEPTION: u8 = 10;
    pub const FUNCTION_NOT_REGISTERED: u8 = 11;
    pub const PROTOCOL_ERROR: u8 = 12;
    pub const MESSAGE_TOO_LARGE: u8 = 14;
    /// The real code does not fit a byte; the body is `(u16 code, string msg)`.
    pub const EXTENDED: u8 = 255;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub magic: u8,
    pub version: u8,
    pub serialize_type: u8,
    pub msg_type: u8,
    pub seq_num: u32,
    pub function_id: u32,
    pub length: u32,
    pub attach_length: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseHeader {
    pub magic: u8,
    pub version: u8,
    pub err_code: u8,
    pub msg_type: u8,
    pub seq_num: u32,
    pub length: u32,
    pub attach_length: u32,
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl RequestHeader {
    /// A request as the Mooncake client builds it.
    pub fn new(seq_num: u32, function_id: u32, length: u32) -> Self {
        RequestHeader {
            magic: MAGIC,
            version: 0,
            serialize_type: 0,
            msg_type: 0,
            seq_num,
            function_id,
            length,
            attach_length: 0,
        }
    }

    pub fn parse(b: &[u8; REQUEST_HEADER_LEN]) -> Self {
        RequestHeader {
            magic: b[0],
            version: b[1],
            serialize_type: b[2],
            msg_type: b[3],
            seq_num: le32(b, 4),
            function_id: le32(b, 8),
            length: le32(b, 12),
            attach_length: le32(b, 16),
        }
    }

    pub fn write(&self, out: &mut BytesMut) {
        out.put_u8(self.magic);
        out.put_u8(self.version);
        out.put_u8(self.serialize_type);
        out.put_u8(self.msg_type);
        out.put_u32_le(self.seq_num);
        out.put_u32_le(self.function_id);
        out.put_u32_le(self.length);
        out.put_u32_le(self.attach_length);
    }

    pub fn frame_len(&self) -> u64 {
        REQUEST_HEADER_LEN as u64 + u64::from(self.length) + u64::from(self.attach_length)
    }
}

impl ResponseHeader {
    pub fn new(seq_num: u32, err_code: u8, length: u32) -> Self {
        ResponseHeader {
            magic: MAGIC,
            version: 0,
            err_code,
            msg_type: 0,
            seq_num,
            length,
            attach_length: 0,
        }
    }

    pub fn parse(b: &[u8; RESPONSE_HEADER_LEN]) -> Self {
        ResponseHeader {
            magic: b[0],
            version: b[1],
            err_code: b[2],
            msg_type: b[3],
            seq_num: le32(b, 4),
            length: le32(b, 8),
            attach_length: le32(b, 12),
        }
    }

    pub fn write(&self, out: &mut BytesMut) {
        out.put_u8(self.magic);
        out.put_u8(self.version);
        out.put_u8(self.err_code);
        out.put_u8(self.msg_type);
        out.put_u32_le(self.seq_num);
        out.put_u32_le(self.length);
        out.put_u32_le(self.attach_length);
    }

    pub fn frame_len(&self) -> u64 {
        RESPONSE_HEADER_LEN as u64 + u64::from(self.length) + u64::from(self.attach_length)
    }
}

/// Checks the start of `buf` for a request frame. `Ok(None)`: more bytes are needed.
/// Errors are reported as soon as the offending header byte is buffered, so garbage is
/// refused without waiting for 20 bytes, and an oversize length before its body arrives.
pub fn check_request(buf: &[u8], max_frame: u64) -> Result<Option<RequestHeader>, FrameError> {
    if let Some(&m) = buf.first()
        && m != MAGIC
    {
        return Err(FrameError::BadMagic(m));
    }
    if let Some(&v) = buf.get(1)
        && v != 0
    {
        return Err(FrameError::UnsupportedVersion(v));
    }
    if let Some(&s) = buf.get(2)
        && s != 0
    {
        return Err(FrameError::UnsupportedSerializeType(s));
    }
    let Some(hb) = buf.first_chunk::<REQUEST_HEADER_LEN>() else {
        return Ok(None);
    };
    let h = RequestHeader::parse(hb);
    let len = h.frame_len();
    if len > max_frame {
        return Err(FrameError::TooLarge {
            len,
            max: max_frame,
        });
    }
    Ok((buf.len() as u64 >= len).then_some(h))
}

/// Checks the start of `buf` for a response frame. Like the Mooncake client, it does not
/// judge magic or version; only the size is bounded.
pub fn check_response(buf: &[u8], max_frame: u64) -> Result<Option<ResponseHeader>, FrameError> {
    let Some(hb) = buf.first_chunk::<RESPONSE_HEADER_LEN>() else {
        return Ok(None);
    };
    let h = ResponseHeader::parse(hb);
    let len = h.frame_len();
    if len > max_frame {
        return Err(FrameError::TooLarge {
            len,
            max: max_frame,
        });
    }
    Ok((buf.len() as u64 >= len).then_some(h))
}

/// A coro_rpc header: what framing needs to know of it.
pub trait Header: Copy {
    /// Bytes before the body.
    const LEN: usize;
    fn length(&self) -> u32;
    fn attach_length(&self) -> u32;
    /// Sets the body and attachment lengths.
    fn set_lengths(&mut self, length: u32, attach_length: u32);
    fn write(&self, out: &mut BytesMut);
}

macro_rules! impl_header {
    ($t:ty, $len:expr) => {
        impl Header for $t {
            const LEN: usize = $len;
            fn length(&self) -> u32 {
                self.length
            }
            fn attach_length(&self) -> u32 {
                self.attach_length
            }
            fn set_lengths(&mut self, length: u32, attach_length: u32) {
                self.length = length;
                self.attach_length = attach_length;
            }
            fn write(&self, out: &mut BytesMut) {
                <$t>::write(self, out)
            }
        }
    };
}
impl_header!(RequestHeader, REQUEST_HEADER_LEN);
impl_header!(ResponseHeader, RESPONSE_HEADER_LEN);

/// A whole frame: header, body and attachment as slices of one buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<H> {
    pub header: H,
    pub body: Bytes,
    pub attachment: Bytes,
}

/// A whole request frame.
pub type RequestFrame = Frame<RequestHeader>;
/// A whole response frame.
pub type ResponseFrame = Frame<ResponseHeader>;

impl<H: Header> Frame<H> {
    /// Cuts the frame announced by `h` (from [`check_request`] / [`check_response`]) off
    /// the front of `buf`; also returns the frame's raw bytes.
    pub fn split(buf: &mut BytesMut, h: H) -> (Frame<H>, Bytes) {
        let body_end = H::LEN + h.length() as usize;
        let raw = buf.split_to(body_end + h.attach_length() as usize).freeze();
        (
            Frame {
                header: h,
                body: raw.slice(H::LEN..body_end),
                attachment: raw.slice(body_end..),
            },
            raw,
        )
    }

    /// Writes the frame with the header's lengths set to the actual body and attachment.
    pub fn write(&self, out: &mut BytesMut) {
        let mut h = self.header;
        h.set_lengths(self.body.len() as u32, self.attachment.len() as u32);
        h.write(out);
        out.extend_from_slice(&self.body);
        out.extend_from_slice(&self.attachment);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: u64 = 1 << 20;

    fn req(seq: u32, body: &[u8]) -> BytesMut {
        let mut b = BytesMut::new();
        RequestHeader::new(seq, 0x1234, body.len() as u32).write(&mut b);
        b.extend_from_slice(body);
        b
    }

    #[test]
    fn partial_then_whole() {
        let full = req(7, b"abc");
        for cut in 0..full.len() {
            assert_eq!(check_request(&full[..cut], MAX), Ok(None), "cut at {cut}");
        }
        let h = check_request(&full, MAX).unwrap().unwrap();
        assert_eq!((h.seq_num, h.length), (7, 3));
        let mut buf = full.clone();
        buf.extend_from_slice(b"next");
        let (f, raw) = RequestFrame::split(&mut buf, h);
        assert_eq!(&f.body[..], b"abc");
        assert_eq!(&raw[..], &full[..]);
        assert_eq!(&buf[..], b"next");
    }

    #[test]
    fn garbage_is_refused_from_the_first_byte() {
        assert_eq!(check_request(b"G", MAX), Err(FrameError::BadMagic(b'G')));
        assert_eq!(
            check_request(&[21, 1], MAX),
            Err(FrameError::UnsupportedVersion(1))
        );
        assert_eq!(
            check_request(&[21, 0, 2], MAX),
            Err(FrameError::UnsupportedSerializeType(2))
        );
    }

    #[test]
    fn four_gib_length_is_refused_before_the_body() {
        let mut b = BytesMut::new();
        let mut h = RequestHeader::new(1, 2, u32::MAX);
        h.attach_length = u32::MAX;
        h.write(&mut b);
        assert_eq!(
            check_request(&b, MAX),
            Err(FrameError::TooLarge {
                len: 20 + 2 * u64::from(u32::MAX),
                max: MAX
            })
        );
        let mut r = BytesMut::new();
        ResponseHeader::new(1, 0, u32::MAX).write(&mut r);
        assert!(matches!(
            check_response(&r, MAX),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn attachment_is_kept_apart() {
        let mut b = BytesMut::new();
        let mut h = RequestHeader::new(1, 2, 2);
        h.attach_length = 3;
        h.write(&mut b);
        b.extend_from_slice(b"bbaaa");
        let h = check_request(&b, MAX).unwrap().unwrap();
        let (f, _) = RequestFrame::split(&mut b, h);
        assert_eq!((&f.body[..], &f.attachment[..]), (&b"bb"[..], &b"aaa"[..]));
        let mut out = BytesMut::new();
        f.write(&mut out);
        assert_eq!(out.len(), 25);
    }
}
