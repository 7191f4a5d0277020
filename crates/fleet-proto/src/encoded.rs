//! A message that is already encoded: a server that keeps the encoding of what it answers (a
//! machine, between its changes) sends those bytes as the response without building the
//! generated message again. On the wire it is whatever message the bytes encode.

use prost::bytes::{Buf, BufMut, Bytes};
use prost::encoding::{self, DecodeContext, WireType};

/// The encoded fields of one message (what `prost::Message::encode_to_vec` returns for it).
#[derive(Clone, PartialEq, Eq, Default, Debug)]
pub struct Encoded(pub Bytes);

impl prost::Message for Encoded {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }

    /// Decoding keeps every field as it came (canonical varints), so that decoding and
    /// encoding again gives the same message.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        let mut out = Vec::from(std::mem::take(&mut self.0));
        match wire_type {
            WireType::Varint => {
                let mut value = 0u64;
                encoding::uint64::merge(wire_type, &mut value, buf, ctx)?;
                encoding::encode_key(tag, wire_type, &mut out);
                encoding::encode_varint(value, &mut out);
            }
            WireType::ThirtyTwoBit => {
                let mut value = 0u32;
                encoding::fixed32::merge(wire_type, &mut value, buf, ctx)?;
                encoding::encode_key(tag, wire_type, &mut out);
                out.extend_from_slice(&value.to_le_bytes());
            }
            WireType::SixtyFourBit => {
                let mut value = 0u64;
                encoding::fixed64::merge(wire_type, &mut value, buf, ctx)?;
                encoding::encode_key(tag, wire_type, &mut out);
                out.extend_from_slice(&value.to_le_bytes());
            }
            WireType::LengthDelimited => {
                let mut value = Vec::new();
                encoding::bytes::merge(wire_type, &mut value, buf, ctx)?;
                encoding::bytes::encode(tag, &value, &mut out);
            }
            // Groups are not part of proto3 messages: skipped, not kept.
            WireType::StartGroup | WireType::EndGroup => {
                encoding::skip_field(wire_type, tag, buf, ctx)?
            }
        }
        self.0 = Bytes::from(out);
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn clear(&mut self) {
        self.0 = Bytes::new();
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::v1alpha1::{HostRef, Machine};

    fn machine() -> Machine {
        Machine {
            id: "m-1".into(),
            state: 3,
            host: Some(HostRef {
                provider: "p".into(),
                r#ref: "7".into(),
            }),
            price_per_hour: 0.25,
            labels: [("k".to_owned(), "v".to_owned())].into(),
            ..Machine::default()
        }
    }

    #[test]
    fn encoded_bytes_are_sent_as_they_are_and_decode_back_to_the_same_bytes() {
        let bytes = machine().encode_to_vec();
        let encoded = Encoded(Bytes::from(bytes.clone()));
        assert_eq!(encoded.encoded_len(), bytes.len());
        assert_eq!(encoded.encode_to_vec(), bytes);
        assert_eq!(
            Machine::decode(encoded.encode_to_vec().as_slice()).unwrap(),
            machine()
        );
        let again = Encoded::decode(bytes.as_slice()).unwrap();
        assert_eq!(again, encoded);
        assert!(Encoded::decode(&bytes[..bytes.len() - 1]).is_err());
    }
}
