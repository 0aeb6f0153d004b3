//! The one place pdkv encodes messages: bincode 2.0.1 (serde), bounded.
//!
//! Encoding and decoding are pure; framing on streams lives in `pdkv_transport::codec`. Decoding
//! is bounded by [`MAX_FRAME_BYTES`] (a length field inside the payload cannot ask for more) and
//! a payload with trailing bytes is refused.
//!
//! bincode is pinned at 2.0.1 (3.x is an empty crate) and no other module names it.

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Largest frame payload a node accepts or sends (16 MiB): a block-list message for a 1M-token
/// prompt is about 64 KiB, so this leaves room while bounding memory per connection.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

fn config() -> bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<MAX_FRAME_BYTES>,
> {
    bincode::config::standard()
        .with_little_endian()
        .with_limit::<MAX_FRAME_BYTES>()
}

/// Encodes a message.
pub fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CodecError> {
    let bytes = bincode::serde::encode_to_vec(value, config())
        .map_err(|error| CodecError::Encode(error.to_string()))?;
    if bytes.len() > MAX_FRAME_BYTES {
        return Err(CodecError::Oversize {
            len: bytes.len() as u64,
            max: MAX_FRAME_BYTES,
        });
    }
    Ok(bytes)
}

/// Decodes a message; the whole payload must be consumed.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    if bytes.len() > MAX_FRAME_BYTES {
        return Err(CodecError::Oversize {
            len: bytes.len() as u64,
            max: MAX_FRAME_BYTES,
        });
    }
    let (value, used) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|error| CodecError::Decode(error.to_string()))?;
    if used != bytes.len() {
        return Err(CodecError::TrailingBytes {
            extra: bytes.len() - used,
        });
    }
    Ok(value)
}

/// Why a frame could not be read, written or decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// The frame claims or holds more bytes than allowed.
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    Oversize {
        /// Claimed or actual length.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// The stream ended inside a frame.
    #[error("stream ended inside a frame")]
    Truncated,
    /// The payload is not a valid message.
    #[error("malformed message: {0}")]
    Decode(String),
    /// The payload decoded but left bytes over.
    #[error("malformed message: {extra} trailing bytes")]
    TrailingBytes {
        /// Bytes left over.
        extra: usize,
    },
    /// The message could not be encoded.
    #[error("cannot encode message: {0}")]
    Encode(String),
    /// The stream failed.
    #[error("stream error: {0}")]
    Io(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{Body, Envelope, Incarnation, NodeId, RequestId};

    fn envelope() -> Envelope {
        Envelope {
            request: RequestId(9),
            from: NodeId("decode-0".into()),
            incarnation: Incarnation(77),
            budget_ms: 1_000,
            body: Body::Abort,
        }
    }

    #[test]
    fn messages_round_trip() {
        let bytes = encode(&envelope()).unwrap();
        assert_eq!(decode::<Envelope>(&bytes), Ok(envelope()));
    }

    #[test]
    fn trailing_oversize_and_garbage_payloads_are_refused() {
        let mut bytes = encode(&envelope()).unwrap();
        bytes.extend_from_slice(&[0, 0]);
        assert_eq!(
            decode::<Envelope>(&bytes),
            Err(CodecError::TrailingBytes { extra: 2 })
        );
        let huge = vec![0u8; MAX_FRAME_BYTES + 1];
        assert_eq!(
            decode::<Envelope>(&huge),
            Err(CodecError::Oversize {
                len: MAX_FRAME_BYTES as u64 + 1,
                max: MAX_FRAME_BYTES
            })
        );
        assert!(matches!(
            decode::<Envelope>(&[0xFF; 16]),
            Err(CodecError::Decode(_))
        ));
        // A length claim inside the payload cannot make decoding allocate past the limit.
        let mut claim = vec![0xFD];
        claim.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode::<Vec<u8>>(&claim), Err(CodecError::Decode(_))));
    }

    #[test]
    fn an_encoding_larger_than_a_frame_is_refused() {
        let big = vec![7u8; MAX_FRAME_BYTES + 1];
        // 16 MiB + 1 payload bytes plus a 5-byte varint length prefix.
        assert_eq!(
            encode(&big),
            Err(CodecError::Oversize {
                len: MAX_FRAME_BYTES as u64 + 6,
                max: MAX_FRAME_BYTES
            })
        );
        let fits = vec![7u8; 1024];
        assert_eq!(decode::<Vec<u8>>(&encode(&fits).unwrap()), Ok(fits));
    }
}
