//! `bigfleet.v1alpha1.MachineList`, written by hand instead of generated: besides the decoded
//! `machines` it can carry machines that are already encoded (`encoded`), which a server keeps
//! per machine so that a List of 100,000 machines is a copy of bytes, not 100,000 conversions.
//! On the wire it is the generated message: field 1 `repeated Machine machines`, field 2
//! `bytes revision`.

use prost::bytes::{Buf, BufMut, Bytes};
use prost::encoding::{self, DecodeContext, WireType};

use crate::v1alpha1::Machine;

/// A list of machines and the revision cursor of the inventory it came from.
#[derive(Clone, PartialEq, Default, Debug)]
pub struct MachineList {
    /// Field 1: the machines (what a client decodes into).
    pub machines: Vec<Machine>,
    /// Field 2: the opaque cursor.
    pub revision: Vec<u8>,
    /// More field-1 entries, each an already encoded `Machine` message (server side only;
    /// decoding always fills `machines`).
    pub encoded: Vec<Bytes>,
}

impl MachineList {
    /// Encodes one machine for [`MachineList::encoded`].
    pub fn encode_machine(machine: &Machine) -> Bytes {
        let mut buf = Vec::with_capacity(prost::Message::encoded_len(machine));
        prost::Message::encode_raw(machine, &mut buf);
        Bytes::from(buf)
    }
}

impl prost::Message for MachineList {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        encoding::message::encode_repeated(1, &self.machines, buf);
        for machine in &self.encoded {
            encoding::encode_key(1, WireType::LengthDelimited, buf);
            encoding::encode_varint(machine.len() as u64, buf);
            buf.put_slice(machine);
        }
        if !self.revision.is_empty() {
            encoding::bytes::encode(2, &self.revision, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        match tag {
            1 => encoding::message::merge_repeated(wire_type, &mut self.machines, buf, ctx),
            2 => encoding::bytes::merge(wire_type, &mut self.revision, buf, ctx),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let encoded: usize = self
            .encoded
            .iter()
            .map(|m| encoding::key_len(1) + encoding::encoded_len_varint(m.len() as u64) + m.len())
            .sum();
        let revision = if self.revision.is_empty() {
            0
        } else {
            encoding::bytes::encoded_len(2, &self.revision)
        };
        encoding::message::encoded_len_repeated(1, &self.machines) + encoded + revision
    }

    fn clear(&mut self) {
        self.machines.clear();
        self.revision.clear();
        self.encoded.clear();
    }
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::v1alpha1::HostRef;

    fn machine(id: &str) -> Machine {
        Machine {
            id: id.into(),
            state: 3,
            host: Some(HostRef {
                provider: "p".into(),
                r#ref: "7".into(),
            }),
            labels: [("k".to_owned(), "v".to_owned())].into(),
            ..Machine::default()
        }
    }

    #[test]
    fn pre_encoded_machines_decode_like_ordinary_ones() {
        let list = MachineList {
            machines: vec![machine("a")],
            revision: b"42".to_vec(),
            encoded: vec![MachineList::encode_machine(&machine("b"))],
        };
        let bytes = list.encode_to_vec();
        assert_eq!(bytes.len(), list.encoded_len());
        let decoded = MachineList::decode(bytes.as_slice()).unwrap();
        assert_eq!(decoded.machines, vec![machine("a"), machine("b")]);
        assert_eq!(decoded.revision, b"42");
        assert!(decoded.encoded.is_empty());
        // The same bytes as a list of decoded machines.
        let plain = MachineList {
            machines: decoded.machines.clone(),
            revision: b"42".to_vec(),
            encoded: vec![],
        };
        assert_eq!(plain.encode_to_vec(), bytes);
    }
}
