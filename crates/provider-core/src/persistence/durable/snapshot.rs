//! Writing a snapshot: the whole state in one file, written to a temporary name, fsynced,
//! renamed into place and the directory fsynced, so a crash leaves either no snapshot of that
//! generation or a complete one. It ends with a marker that counts its entries.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

use super::codec::{self, FileKind};
use super::layout;
use super::replay::Image;

/// Records of a snapshot hold about this many bytes each.
const RECORD_TARGET: usize = 64 * 1024;
/// The writer hands bytes to the file, and flushes them, in pieces of about this size.
const WRITE_CHUNK: usize = 1 << 20;

/// Writes `image` as snapshot `generation` in `dir`; returns the file's length.
pub(crate) fn write(dir: &Path, generation: u64, image: &Image<Box<[u8]>>) -> io::Result<u64> {
    let name = layout::file_name(FileKind::Snapshot, generation);
    let mut written = 0;
    layout::create_file_atomically(dir, &name, |file| {
        let mut stream = RecordStream {
            file,
            out: Vec::with_capacity(WRITE_CHUNK + RECORD_TARGET),
            open: None,
            entries: 0,
            written: 0,
        };
        stream
            .out
            .extend_from_slice(&codec::encode_header(FileKind::Snapshot, generation));
        stream.single(|out| codec::encode_counters(image.revision, image.next_op, out));
        for encoded in image.slots.values() {
            stream.entry(|out| codec::encode_slot_entry_raw(encoded, out))?;
        }
        for ((shard_id, machine_id), mark) in &image.fences {
            stream.entry(|out| codec::encode_fence(shard_id, machine_id, *mark, out))?;
        }
        let (slots, fences) = (image.slots.len() as u64, image.fences.len() as u64);
        stream.single(|out| codec::encode_snapshot_end(slots, fences, out));
        written = stream.finish()?;
        Ok(())
    })?;
    Ok(written)
}

/// Packs entries into records of about [`RECORD_TARGET`] bytes and writes them out in chunks.
struct RecordStream<'f> {
    file: &'f mut File,
    out: Vec<u8>,
    /// Where the record being filled starts in `out`.
    open: Option<usize>,
    entries: usize,
    written: u64,
}

impl RecordStream<'_> {
    fn entry(&mut self, add: impl FnOnce(&mut Vec<u8>)) -> io::Result<()> {
        let start = *self
            .open
            .get_or_insert_with(|| codec::begin_batch(&mut self.out));
        add(&mut self.out);
        self.entries += 1;
        if self.out.len() - start >= RECORD_TARGET {
            self.close_record();
            if self.out.len() >= WRITE_CHUNK {
                self.file.write_all(&self.out)?;
                // Flush as we go, so the final fsync is short and a large snapshot never holds
                // up the log's fsyncs behind one big flush (ext4 orders them in one journal).
                self.file.sync_data()?;
                self.written += self.out.len() as u64;
                self.out.clear();
            }
        }
        Ok(())
    }

    fn close_record(&mut self) {
        if let Some(start) = self.open.take() {
            codec::finish_batch(&mut self.out, start, self.entries);
            self.entries = 0;
        }
    }

    /// A record of its own holding one entry.
    fn single(&mut self, add: impl FnOnce(&mut Vec<u8>)) {
        self.close_record();
        let start = codec::begin_batch(&mut self.out);
        add(&mut self.out);
        codec::finish_batch(&mut self.out, start, 1);
    }

    fn finish(mut self) -> io::Result<u64> {
        self.close_record();
        self.file.write_all(&self.out)?;
        Ok(self.written + self.out.len() as u64)
    }
}
