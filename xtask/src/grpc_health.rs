//! A minimal `grpc.health.v1.Health/Check` client over cleartext HTTP/2, so the image test
//! can ask a provider running inside a container whether it serves, without pulling a gRPC
//! stack into xtask.
//!
//! It speaks just enough HTTP/2 (RFC 9113) for one unary call on stream 1: the connection
//! preface, SETTINGS and PING acknowledgements, one HEADERS frame whose HPACK block uses only
//! literal fields without indexing (so no Huffman coding or dynamic table is needed on our
//! side), and one DATA frame. The response headers are never decoded: the answer is read from
//! the DATA payload, and a call that ends without one is reported as a failed call.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

const FRAME_DATA: u8 = 0x0;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_RST_STREAM: u8 = 0x3;
const FRAME_SETTINGS: u8 = 0x4;
const FRAME_PING: u8 = 0x6;
const FRAME_GOAWAY: u8 = 0x7;

const FLAG_END_STREAM: u8 = 0x1;
const FLAG_ACK: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;

const STREAM: u32 = 1;
/// Largest frame payload we accept: the protocol's default SETTINGS_MAX_FRAME_SIZE.
const MAX_FRAME: usize = 16_384;

/// `grpc.health.v1.HealthCheckResponse.ServingStatus`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServingStatus {
    Unknown,
    Serving,
    NotServing,
    ServiceUnknown,
    Other(u64),
}

impl ServingStatus {
    fn from_wire(value: u64) -> Self {
        match value {
            0 => Self::Unknown,
            1 => Self::Serving,
            2 => Self::NotServing,
            3 => Self::ServiceUnknown,
            other => Self::Other(other),
        }
    }
}

/// Asks the server at `addr` for the health of `service` ("" is the whole server).
pub(crate) fn check(addr: SocketAddr, service: &str, timeout: Duration) -> Result<ServingStatus> {
    let mut conn =
        TcpStream::connect_timeout(&addr, timeout).with_context(|| format!("connect to {addr}"))?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(timeout))?;
    conn.set_nodelay(true)?;

    let mut out = Vec::new();
    out.extend_from_slice(PREFACE);
    out.extend(frame(FRAME_SETTINGS, 0, 0, &[]));
    out.extend(frame(
        FRAME_HEADERS,
        FLAG_END_HEADERS,
        STREAM,
        &request_headers(&addr.to_string())?,
    ));
    out.extend(frame(
        FRAME_DATA,
        FLAG_END_STREAM,
        STREAM,
        &grpc_message(&health_request(service)),
    ));
    conn.write_all(&out).context("send health check")?;

    let mut body = Vec::new();
    loop {
        let (kind, flags, stream, payload) = read_frame(&mut conn)?;
        match kind {
            FRAME_SETTINGS if flags & FLAG_ACK == 0 => {
                conn.write_all(&frame(FRAME_SETTINGS, FLAG_ACK, 0, &[]))?;
            }
            FRAME_PING if flags & FLAG_ACK == 0 => {
                conn.write_all(&frame(FRAME_PING, FLAG_ACK, 0, &payload))?;
            }
            FRAME_DATA if stream == STREAM => {
                body.extend_from_slice(strip_padding(flags, &payload)?);
                if flags & FLAG_END_STREAM != 0 {
                    break;
                }
            }
            FRAME_HEADERS if stream == STREAM && flags & FLAG_END_STREAM != 0 => break,
            FRAME_RST_STREAM if stream == STREAM => bail!("server reset the health check stream"),
            FRAME_GOAWAY => bail!("server sent GOAWAY before answering"),
            _ => {}
        }
    }
    ensure!(
        !body.is_empty(),
        "health check ended without a response message (the call failed; is grpc.health.v1 registered?)"
    );
    parse_response(&body)
}

/// One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("frame payload fits in 24 bits");
    let mut out = Vec::with_capacity(9 + payload.len());
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
    out.extend_from_slice(payload);
    out
}

fn read_frame(conn: &mut impl Read) -> Result<(u8, u8, u32, Vec<u8>)> {
    let mut head = [0u8; 9];
    conn.read_exact(&mut head)
        .context("read HTTP/2 frame header")?;
    let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
    ensure!(
        len <= MAX_FRAME,
        "HTTP/2 frame of {len} bytes exceeds the default maximum"
    );
    let stream = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
    let mut payload = vec![0u8; len];
    conn.read_exact(&mut payload)
        .context("read HTTP/2 frame payload")?;
    Ok((head[3], head[4], stream, payload))
}

fn strip_padding(flags: u8, payload: &[u8]) -> Result<&[u8]> {
    if flags & FLAG_PADDED == 0 {
        return Ok(payload);
    }
    let (&pad, rest) = payload
        .split_first()
        .context("padded frame without pad length")?;
    let keep = rest
        .len()
        .checked_sub(usize::from(pad))
        .context("padding longer than the frame")?;
    Ok(&rest[..keep])
}

/// The request's HPACK block, every field a "literal without indexing, new name".
fn request_headers(authority: &str) -> Result<Vec<u8>> {
    let mut block = Vec::new();
    for (name, value) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/grpc.health.v1.Health/Check"),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ] {
        block.push(0x00);
        hpack_string(&mut block, name)?;
        hpack_string(&mut block, value)?;
    }
    Ok(block)
}

/// An HPACK string literal, not Huffman coded; lengths fit the 7-bit prefix.
fn hpack_string(out: &mut Vec<u8>, text: &str) -> Result<()> {
    let len = u8::try_from(text.len())
        .ok()
        .filter(|len| *len < 0x7f)
        .with_context(|| format!("header text too long for this client: {text:?}"))?;
    out.push(len);
    out.extend_from_slice(text.as_bytes());
    Ok(())
}

/// `HealthCheckRequest { service = 1 }` in protobuf wire format.
fn health_request(service: &str) -> Vec<u8> {
    if service.is_empty() {
        return Vec::new();
    }
    let mut out = vec![0x0a];
    put_varint(&mut out, service.len() as u64);
    out.extend_from_slice(service.as_bytes());
    out
}

/// gRPC length-prefixed message, uncompressed.
fn grpc_message(message: &[u8]) -> Vec<u8> {
    let len = u32::try_from(message.len()).expect("health request is small");
    let mut out = vec![0];
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// Reads `HealthCheckResponse { status = 1 }` out of one length-prefixed gRPC message.
fn parse_response(body: &[u8]) -> Result<ServingStatus> {
    ensure!(
        body.len() >= 5,
        "truncated gRPC message ({} bytes)",
        body.len()
    );
    ensure!(body[0] == 0, "compressed gRPC response is not supported");
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let message = body
        .get(5..5 + len)
        .context("gRPC message shorter than its prefix")?;

    // proto3 leaves a zero-valued field out: an empty message is UNKNOWN.
    let mut status = 0;
    let mut rest = message;
    while let Some((&key, tail)) = rest.split_first() {
        rest = tail;
        match (key >> 3, key & 7) {
            (1, 0) => status = take_varint(&mut rest)?,
            (_, 0) => {
                take_varint(&mut rest)?;
            }
            (_, 2) => {
                let skip = usize::try_from(take_varint(&mut rest)?)?;
                rest = rest
                    .get(skip..)
                    .context("truncated length-delimited field")?;
            }
            (field, wire) => bail!("unexpected field {field} with wire type {wire}"),
        }
    }
    Ok(ServingStatus::from_wire(status))
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn take_varint(input: &mut &[u8]) -> Result<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&byte, rest) = input.split_first().context("truncated varint")?;
        *input = rest;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(value);
        }
    }
    bail!("varint longer than 64 bits")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_header_layout() {
        let bytes = frame(FRAME_DATA, FLAG_END_STREAM, 1, &[0xaa, 0xbb]);
        assert_eq!(bytes, [0, 0, 2, 0, 1, 0, 0, 0, 1, 0xaa, 0xbb]);
        let (kind, flags, stream, payload) = read_frame(&mut bytes.as_slice()).unwrap();
        assert_eq!(
            (kind, flags, stream, payload),
            (FRAME_DATA, FLAG_END_STREAM, 1, vec![0xaa, 0xbb])
        );
    }

    #[test]
    fn oversized_frame_is_refused() {
        let mut bytes = vec![0x01, 0x00, 0x00, FRAME_DATA, 0, 0, 0, 0, 1];
        bytes.resize(9 + 65_536, 0);
        assert!(read_frame(&mut bytes.as_slice()).is_err());
    }

    #[test]
    fn headers_are_plain_literals() {
        let block = request_headers("127.0.0.1:9000").unwrap();
        let expected_start = [&[0x00, 7][..], b":method", &[4], b"POST"].concat();
        assert!(block.starts_with(&expected_start));
        assert!(
            block
                .windows(28)
                .any(|w| w == b"/grpc.health.v1.Health/Check")
        );
        assert!(hpack_string(&mut Vec::new(), &"x".repeat(127)).is_err());
    }

    #[test]
    fn request_encoding() {
        assert_eq!(grpc_message(&health_request("")), [0, 0, 0, 0, 0]);
        assert_eq!(health_request("ab"), [0x0a, 2, b'a', b'b']);
    }

    #[test]
    fn response_decoding() {
        assert_eq!(
            parse_response(&[0, 0, 0, 0, 2, 0x08, 0x01]).unwrap(),
            ServingStatus::Serving
        );
        assert_eq!(
            parse_response(&[0, 0, 0, 0, 2, 0x08, 0x02]).unwrap(),
            ServingStatus::NotServing
        );
        assert_eq!(
            parse_response(&[0, 0, 0, 0, 0]).unwrap(),
            ServingStatus::Unknown
        );
        // An unknown length-delimited field before the status is skipped.
        let body = [0, 0, 0, 0, 5, 0x12, 1, b'x', 0x08, 0x03];
        assert_eq!(
            parse_response(&body).unwrap(),
            ServingStatus::ServiceUnknown
        );
        assert!(parse_response(&[0, 0, 0, 0, 4, 0x08]).is_err());
        assert!(parse_response(&[1, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn padding_is_removed() {
        assert_eq!(
            strip_padding(FLAG_PADDED, &[2, 7, 8, 0, 0]).unwrap(),
            &[7, 8]
        );
        assert_eq!(strip_padding(0, &[2, 7]).unwrap(), &[2, 7]);
        assert!(strip_padding(FLAG_PADDED, &[9, 1]).is_err());
    }

    #[test]
    fn varints_round_trip() {
        for value in [0, 1, 127, 128, 300, u64::from(u32::MAX), u64::MAX] {
            let mut bytes = Vec::new();
            put_varint(&mut bytes, value);
            let mut slice = bytes.as_slice();
            assert_eq!(take_varint(&mut slice).unwrap(), value);
            assert!(slice.is_empty());
        }
    }
}
