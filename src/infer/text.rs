//! [`TextOut`]: a sequence's generated tokens as text, piece by piece as they come, and its stop
//! strings. A token is decoded with the few tokens before it and the new part of the text is what
//! it adds, so tokenizers whose pieces depend on their neighbours (a leading space, a character
//! split over byte tokens) give the same text as decoding everything at once; an incomplete
//! character waits for the next token. Text that could be the start of a stop string is held back
//! until it is known not to be one; a stop string ends the text before it.

use crate::data::Codec;

/// Tokens decoded before the new ones, for their context.
const CONTEXT_TOKENS: usize = 6;
/// Tokens decoded together at most while a character stays incomplete.
const PENDING_MAX: usize = 16;

/// Incremental detokenizer with stop strings; see the module documentation.
#[derive(Debug, Default)]
pub struct TextOut {
    tokens: Vec<u32>,
    /// `tokens[prefix..read]` gave the text already taken; `tokens[read..]` is pending.
    prefix: usize,
    read: usize,
    /// All text so far (stop strings cut), and how much of it was handed out.
    text: String,
    sent: usize,
    stop: Vec<String>,
    stopped: bool,
}

impl TextOut {
    /// Ends the text before the first of `stop` (empty strings are ignored).
    pub fn new(stop: Vec<String>) -> TextOut {
        TextOut { stop: stop.into_iter().filter(|s| !s.is_empty()).collect(), ..TextOut::default() }
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The whole text so far (up to a stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Adds a token; the text that can be shown now (maybe empty).
    pub fn push(&mut self, codec: &Codec, token: u32) -> String {
        if self.stopped {
            return String::new();
        }
        self.tokens.push(token);
        let before = codec.decode(&self.tokens[self.prefix..self.read]);
        let now = codec.decode(&self.tokens[self.prefix..]);
        let incomplete = now.ends_with(char::REPLACEMENT_CHARACTER) && self.tokens.len() - self.read < PENDING_MAX;
        match now.get(before.len()..).filter(|_| !incomplete && now.starts_with(&before)) {
            Some(new) => {
                self.text.push_str(new);
                self.read = self.tokens.len();
                self.prefix = self.read.saturating_sub(CONTEXT_TOKENS);
            }
            None if !incomplete && self.tokens.len() - self.read >= PENDING_MAX => {
                // A decoder that rewrites earlier text: take the pending tokens as they decode alone.
                self.text.push_str(&codec.decode(&self.tokens[self.read..]));
                self.read = self.tokens.len();
                self.prefix = self.read;
            }
            None => {}
        }
        self.release(false)
    }

    /// The rest of the text at the end of the sequence (held-back text that was no stop string).
    pub fn finish(&mut self, codec: &Codec) -> String {
        if !self.stopped && self.read < self.tokens.len() {
            let before = codec.decode(&self.tokens[self.prefix..self.read]);
            let now = codec.decode(&self.tokens[self.prefix..]);
            self.text.push_str(now.get(before.len()..).unwrap_or(&now));
            self.read = self.tokens.len();
        }
        self.release(true)
    }

    /// Cuts the text at a stop string and hands out what is certain.
    fn release(&mut self, all: bool) -> String {
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        let from = floor_char(&self.text, self.sent.saturating_sub(longest));
        let hit = self.stop.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i)).min();
        if let Some(at) = hit {
            self.text.truncate(at);
            self.stopped = true;
        }
        let mut upto = self.text.len();
        if !all && !self.stopped {
            // Hold back a tail that is the start of a stop string.
            let held = self.stop.iter().map(|s| held_back(&self.text, s)).max().unwrap_or(0);
            upto -= held;
        }
        let out = self.text.get(self.sent..upto).unwrap_or_default().to_string();
        self.sent = self.sent.max(upto);
        out
    }
}

/// The largest char boundary of `s` at or before `i`.
fn floor_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

/// The length of the longest proper start of `stop` that `text` ends with.
fn held_back(text: &str, stop: &str) -> usize {
    (1..stop.len()).rev().find(|&k| stop.is_char_boundary(k) && text.ends_with(&stop[..k])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stop: &[&str], text: &str) -> (Vec<String>, String, bool) {
        let codec = Codec::Bytes;
        let mut out = TextOut::new(stop.iter().map(|s| s.to_string()).collect());
        let mut pieces: Vec<String> = text.bytes().map(|b| out.push(&codec, u32::from(b))).collect();
        pieces.push(out.finish(&codec));
        (pieces, out.text().to_string(), out.stopped())
    }

    #[test]
    fn pieces_add_up_to_the_text_and_multibyte_characters_wait_whole() {
        let (pieces, text, stopped) = run(&[], "café ☕!");
        assert_eq!(pieces.concat(), "café ☕!");
        assert_eq!(text, "café ☕!");
        assert!(!stopped);
        assert!(pieces.iter().all(|p| !p.contains(char::REPLACEMENT_CHARACTER)), "{pieces:?}");
        assert!(pieces.contains(&"☕".to_string()), "{pieces:?}");
    }

    #[test]
    fn a_stop_string_ends_the_text_before_it_and_its_start_is_held_back() {
        let (pieces, text, stopped) = run(&["\n\n", "END"], "one EN two\n\nthree");
        assert_eq!(text, "one EN two");
        assert!(stopped);
        assert_eq!(pieces.concat(), "one EN two");
        // "E" and "EN" were held back until " " showed they start no "END".
        assert_eq!(pieces[4..7], ["", "", "EN "]);
    }

    #[test]
    fn a_held_back_start_is_handed_out_at_the_end() {
        let (pieces, text, stopped) = run(&["ENDING"], "the END");
        assert_eq!((pieces.concat(), text, stopped), ("the END".to_string(), "the END".to_string(), false));
    }
}
