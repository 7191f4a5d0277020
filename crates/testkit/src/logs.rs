//! Log lines captured from `tracing` on the current thread.

use std::sync::{Arc, Mutex};

/// Captures the log lines of the current thread once [`LogCapture::install`]ed (or of
/// whatever subscriber it is the writer of).
#[derive(Clone, Default)]
pub struct LogCapture(Arc<Mutex<Vec<u8>>>);

impl LogCapture {
    /// Makes this capture the current thread's subscriber (every level, no colour) until the
    /// guard drops.
    pub fn install(&self) -> tracing::subscriber::DefaultGuard {
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_writer(self.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::set_default(subscriber)
    }

    /// What was captured so far.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// How many times `needle` was logged so far.
    pub fn count(&self, needle: &str) -> usize {
        self.text().matches(needle).count()
    }
}

/// How many of the recorded `lines` (requests, commands) are exactly `line`.
pub fn occurrences(lines: &[impl AsRef<str>], line: &str) -> usize {
    lines.iter().filter(|l| l.as_ref() == line).count()
}

impl std::io::Write for LogCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogCapture {
    type Writer = LogCapture;

    fn make_writer(&'a self) -> LogCapture {
        self.clone()
    }
}

/// Copies a child process's stdout and stderr, as they come, into one buffer; the tasks doing
/// it end when the streams close.
pub fn collect_output(
    child: &mut tokio::process::Child,
) -> (Arc<Mutex<Vec<u8>>>, Vec<tokio::task::JoinHandle<()>>) {
    let output = Arc::new(Mutex::new(Vec::new()));
    let mut readers = Vec::new();
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn tokio::io::AsyncRead + Unpin + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let output = output.clone();
        readers.push(tokio::spawn(async move {
            use tokio::io::AsyncReadExt as _;
            let mut stream = stream;
            let mut buf = [0u8; 4096];
            while let Ok(n) = stream.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                output.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        }));
    }
    (output, readers)
}
