//! Length-prefixed frames of encoded messages on async streams.
//!
//! A frame is a little-endian `u32` payload length followed by the payload. Readers check the
//! length against a maximum *before* allocating, so a hostile or broken peer cannot make a node
//! allocate more than [`MAX_FRAME_BYTES`]; decoding is bounded by the same limit (a length field
//! inside the payload cannot ask for more), and a payload with trailing bytes is refused.
//! "Not yet" (a truncated frame) is an error for a stream that ended, never a panic.
//!
//! The encoding itself (bincode 2.0.1) lives in `pdkv_core::codec`, the one module that names
//! bincode, so the simulation in `pdkv_core::testing` encodes exactly as the network does.

pub use pdkv_core::codec::{CodecError, MAX_FRAME_BYTES, decode, encode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Version of the pdkv wire protocol; peers with another version are refused at handshake. 2: a
/// data reply says how many padding bytes come before its data. 3: engine descriptors carry
/// engine-specific packed bytes (mori's descriptors). 4: a failure carries the typed allocator,
/// exchange, plan and grant errors instead of their text; the prompt travels once, in the decode
/// request, not back and forth inside the KV parameters. 5: the hello names the model
/// fields two nodes must agree on (`pdkv_core::identity::ModelFields`). 6: a vLLM connector's claim
/// says how many decode workers read the hand-off (legs of different tensor-parallel sizes). 7: a
/// failure's bad KV parameters are typed (`pdkv_core::wire::ParamsError`), not text.
pub const PROTOCOL_VERSION: u32 = 7;

/// QUIC ALPN of the pdkv control plane.
pub const ALPN: &[u8] = b"pdkv/1";

/// Prefixes `payload` with its length, ready to write.
pub fn frame(payload: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(payload);
    frame
}

/// Writes one frame holding `value`.
pub async fn write_message<W: AsyncWrite + Unpin, T: Serialize>(
    writer: &mut W,
    value: &T,
) -> Result<(), CodecError> {
    writer.write_all(&frame(&encode(value)?)).await.map_err(io)
}

/// Reads one frame of at most `max` payload bytes and decodes it.
pub async fn read_message<R: AsyncRead + Unpin, T: DeserializeOwned>(
    reader: &mut R,
    max: usize,
) -> Result<T, CodecError> {
    let payload = read_frame(reader, max).await?;
    decode(&payload)
}

/// Reads one frame's payload, refusing a length above `max` before allocating.
pub async fn read_frame<R: AsyncRead + Unpin>(reader: &mut R, max: usize) -> Result<Vec<u8>, CodecError> {
    let mut header = [0u8; 4];
    read_exact(reader, &mut header).await?;
    read_payload(reader, u32::from_le_bytes(header), max).await
}

/// Reads a payload of `len` bytes after its header, refusing it before allocating if it is
/// above `max` (or the frame limit).
async fn read_payload<R: AsyncRead + Unpin>(
    reader: &mut R,
    len: u32,
    max: usize,
) -> Result<Vec<u8>, CodecError> {
    let len = len as usize;
    if len > max.min(MAX_FRAME_BYTES) {
        return Err(CodecError::Oversize {
            len: len as u64,
            max: max.min(MAX_FRAME_BYTES),
        });
    }
    // Grow with the bytes that really arrive: a header alone cannot make a node allocate the
    // length it claims.
    let mut payload = Vec::with_capacity(len.min(INITIAL_PAYLOAD_CAPACITY));
    let read = (&mut *reader)
        .take(len as u64)
        .read_to_end(&mut payload)
        .await
        .map_err(io)?;
    if read < len {
        return Err(CodecError::Truncated);
    }
    Ok(payload)
}

/// Bytes reserved for a payload before any of it arrives.
const INITIAL_PAYLOAD_CAPACITY: usize = 64 * 1024;

/// Reads the next frame's payload of a stream of frames, or `None` if the stream ended cleanly
/// between frames.
pub async fn read_next_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    max: usize,
) -> Result<Option<Vec<u8>>, CodecError> {
    let mut first = [0u8; 1];
    if reader.read(&mut first).await.map_err(io)? == 0 {
        return Ok(None);
    }
    let mut rest = [0u8; 3];
    read_exact(reader, &mut rest).await?;
    let len = u32::from_le_bytes([first[0], rest[0], rest[1], rest[2]]);
    read_payload(reader, len, max).await.map(Some)
}

async fn read_exact<R: AsyncRead + Unpin>(reader: &mut R, buffer: &mut [u8]) -> Result<(), CodecError> {
    match reader.read_exact(buffer).await {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => Err(CodecError::Truncated),
        Err(error) => Err(io(error)),
    }
}

fn io(error: std::io::Error) -> CodecError {
    CodecError::Io(error.to_string())
}

#[cfg(test)]
mod tests {
    use pdkv_core::exchange::{ExchangeList, Offer};
    use pdkv_core::layout::GroupSpec;
    use pdkv_core::wire::{GrantId, Incarnation, KvParams, NodeId, RequestId};
    use proptest::prelude::*;

    use super::*;

    fn params() -> KvParams {
        KvParams {
            request: RequestId(9),
            prefill_node: NodeId("prefill-0".into()),
            prefill_incarnation: Incarnation(0x5eed),
            offer: Offer {
                num_prompt_tokens: 440,
                groups: vec![ExchangeList {
                    spec: GroupSpec::sliding_window(64, 128, 1).unwrap(),
                    first_position: 4,
                    blocks: vec![14, 15, 16],
                }],
            },
            generations: vec![vec![1, 2, 3]],
            grant: GrantId(3),
            lease_ms: 100,
        }
    }

    #[test]
    fn messages_round_trip_through_frames() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut buffer = Vec::new();
            write_message(&mut buffer, &params()).await.unwrap();
            let decoded: KvParams = read_message(&mut buffer.as_slice(), MAX_FRAME_BYTES)
                .await
                .unwrap();
            assert_eq!(decoded, params());
        });
    }

    #[test]
    fn oversize_truncated_and_trailing_frames_are_refused() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let huge = (u32::MAX).to_le_bytes();
            let error = read_frame(&mut huge.as_slice(), MAX_FRAME_BYTES)
                .await
                .unwrap_err();
            assert_eq!(
                error.to_string(),
                "frame of 4294967295 bytes exceeds the 16777216-byte limit"
            );
            let mut buffer = Vec::new();
            write_message(&mut buffer, &params()).await.unwrap();
            let cut = &buffer[..buffer.len() - 1];
            assert_eq!(
                read_frame(&mut &cut[..], MAX_FRAME_BYTES).await,
                Err(CodecError::Truncated)
            );
            let mut payload = encode(&params()).unwrap();
            payload.push(0);
            assert!(matches!(
                decode::<KvParams>(&payload),
                Err(CodecError::TrailingBytes { extra: 1 })
            ));
        });
    }

    /// A stream of frames ends cleanly only between frames: frames in order, then `None`; a
    /// stream cut inside a header or a payload, or announcing an oversize frame, is an error.
    #[test]
    fn a_stream_of_frames_ends_only_between_frames() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut stream = Vec::new();
            for payload in [&b"one"[..], &b""[..], &b"three"[..]] {
                stream.extend(frame(payload));
            }
            let mut reader = stream.as_slice();
            for expected in [&b"one"[..], &b""[..], &b"three"[..]] {
                let payload = read_next_frame(&mut reader, 64).await.unwrap();
                assert_eq!(payload.as_deref(), Some(expected));
            }
            assert_eq!(read_next_frame(&mut reader, 64).await, Ok(None));
            for cut in [1, 3, 5] {
                let mut reader = &stream[..cut];
                assert_eq!(
                    read_next_frame(&mut reader, 64).await,
                    Err(CodecError::Truncated),
                    "cut at {cut}"
                );
            }
            let oversize = frame(&[7u8; 65]);
            assert_eq!(
                read_next_frame(&mut oversize.as_slice(), 64).await,
                Err(CodecError::Oversize { len: 65, max: 64 })
            );
            assert_eq!(
                read_next_frame(&mut frame(&[7u8; 64]).as_slice(), 64).await,
                Ok(Some(vec![7u8; 64]))
            );
        });
    }

    /// A caller's own limit (the data hello's 4096 bytes) holds exactly: a frame of `limit` bytes
    /// is read, one of `limit + 1` is refused before its payload is read.
    #[test]
    fn the_callers_limit_is_exact() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            for limit in [0usize, 1, 4096] {
                let at_limit = frame(&vec![7u8; limit]);
                assert_eq!(
                    read_frame(&mut at_limit.as_slice(), limit).await,
                    Ok(vec![7u8; limit])
                );
                // Only the header of the oversize frame is present: refusing must not need more.
                let over = ((limit + 1) as u32).to_le_bytes();
                assert_eq!(
                    read_frame(&mut over.as_slice(), limit).await,
                    Err(CodecError::Oversize {
                        len: limit as u64 + 1,
                        max: limit
                    })
                );
            }
            // The global bound applies even when a caller asks for more.
            let over = ((MAX_FRAME_BYTES + 1) as u32).to_le_bytes();
            assert_eq!(
                read_frame(&mut over.as_slice(), usize::MAX).await,
                Err(CodecError::Oversize {
                    len: MAX_FRAME_BYTES as u64 + 1,
                    max: MAX_FRAME_BYTES
                })
            );
        });
    }

    proptest! {
        /// Arbitrary bytes never panic the decoder, and a length claim inside the payload can
        /// never make it allocate past the frame limit.
        #[test]
        fn arbitrary_bytes_decode_to_an_error_or_a_message(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
            let _ = decode::<KvParams>(&bytes);
            let _ = decode::<Vec<Vec<u32>>>(&bytes);
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            runtime.block_on(async {
                let _ = read_message::<_, KvParams>(&mut bytes.as_slice(), 4096).await;
            });
        }

        /// Flipping bytes of a valid frame gives an error or a message, never a panic.
        #[test]
        fn corrupted_frames_never_panic(index in any::<prop::sample::Index>(), value in any::<u8>()) {
            let mut payload = encode(&params()).unwrap();
            let at = index.index(payload.len());
            payload[at] = value;
            let _ = decode::<KvParams>(&payload);
        }
    }
}
