//! Tests of the monitors: TFRecord/protobuf decoding of what we wrote, CRC vectors, CSV, JSONL,
//! MonitorSet fan-out and the SVG chart.

use std::fs;
use std::path::Path;

use super::*;

/// A decoded Event proto (only the fields we write).
#[derive(Debug, Default, PartialEq)]
struct Decoded {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    scalar: Option<(String, f32)>,
}

fn read_varint(buf: &[u8], pos: &mut usize) -> u64 {
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let b = buf[*pos];
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return v;
        }
        shift += 7;
    }
}

/// Iterate (field number, wire type, payload bytes or varint value) over a protobuf message.
fn fields(buf: &[u8]) -> Vec<(u64, u64, Vec<u8>, u64)> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < buf.len() {
        let key = read_varint(buf, &mut pos);
        let (field, wire) = (key >> 3, key & 7);
        match wire {
            0 => out.push((field, wire, vec![], read_varint(buf, &mut pos))),
            1 => {
                out.push((field, wire, buf[pos..pos + 8].to_vec(), 0));
                pos += 8;
            }
            2 => {
                let len = read_varint(buf, &mut pos) as usize;
                out.push((field, wire, buf[pos..pos + len].to_vec(), 0));
                pos += len;
            }
            5 => {
                out.push((field, wire, buf[pos..pos + 4].to_vec(), 0));
                pos += 4;
            }
            w => panic!("unexpected wire type {w}"),
        }
    }
    out
}

fn decode_event(buf: &[u8]) -> Decoded {
    let mut ev = Decoded::default();
    for (field, _, bytes, varint) in fields(buf) {
        match field {
            1 => ev.wall_time = f64::from_le_bytes(bytes.try_into().unwrap()),
            2 => ev.step = varint as i64,
            3 => ev.file_version = Some(String::from_utf8(bytes).unwrap()),
            5 => {
                let (_, _, value, _) = fields(&bytes).into_iter().next().unwrap();
                let mut tag = String::new();
                let mut simple = f32::NAN;
                for (f, wire, b, _) in fields(&value) {
                    match (f, wire) {
                        (1, 2) => tag = String::from_utf8(b).unwrap(),
                        (2, 5) => simple = f32::from_le_bytes(b.try_into().unwrap()),
                        other => panic!("unexpected Value field {other:?}"),
                    }
                }
                ev.scalar = Some((tag, simple));
            }
            f => panic!("unexpected Event field {f}"),
        }
    }
    ev
}

/// Read a TFRecord file, checking both masked CRCs of every record.
fn read_records(path: &Path) -> Vec<Decoded> {
    let bytes = fs::read(path).unwrap();
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < bytes.len() {
        let len_bytes = &bytes[pos..pos + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[pos + 8..pos + 12].try_into().unwrap());
        assert_eq!(len_crc, masked_crc32c(len_bytes), "length crc at {pos}");
        let data = &bytes[pos + 12..pos + 12 + len];
        let data_crc = u32::from_le_bytes(bytes[pos + 12 + len..pos + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, masked_crc32c(data), "data crc at {pos}");
        out.push(decode_event(data));
        pos += 16 + len;
    }
    out
}

#[test]
fn masked_crc32c_known_vectors() {
    assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    // mask(0xE3069283) = rotr15 (0x2507C60D) + 0xa282ead8, wrapping.
    assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
    // crc32c("") = 0 -> mask = 0xa282ead8.
    assert_eq!(masked_crc32c(b""), 0xA282_EAD8);
    let len8 = 0u64.to_le_bytes();
    let crc = crc32c::crc32c(&len8);
    #[allow(clippy::manual_rotate)] // the TFRecord spec's formula, spelled out on purpose
    let spec_mask = ((crc >> 15) | (crc << 17)).wrapping_add(0xa282_ead8);
    assert_eq!(masked_crc32c(&len8), spec_mask);
}

#[test]
fn tensorboard_file_decodes_back() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = TensorboardOpts { output_path: tmp.path().to_path_buf(), job_name: "job1".into() };
    let mut tb = TensorboardMonitor::new(&opts).unwrap();
    let path = tb.path().to_path_buf();
    assert_eq!(path.parent().unwrap(), tmp.path().join("job1"));
    assert!(path.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."));
    let events = [
        Event::new("Train/Samples/train_loss", 3.25, 1),
        Event::new("Train/Samples/lr", 6e-4, 1),
        Event::new("Train/Samples/train_loss", 2.5, 300),
        Event::new("big_step", -1.0, 1 << 40),
    ];
    tb.write(&events).unwrap();
    tb.flush().unwrap();
    let recs = read_records(&path);
    assert_eq!(recs.len(), 5);
    assert_eq!(recs[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(recs[0].wall_time > 1.6e9);
    for (rec, ev) in recs[1..].iter().zip(&events) {
        assert_eq!(rec.step, ev.step as i64);
        assert_eq!(rec.scalar, Some((ev.tag.clone(), ev.value as f32)));
        assert!(rec.file_version.is_none());
    }
}

#[test]
fn two_tensorboard_monitors_get_distinct_files() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = TensorboardOpts { output_path: tmp.path().to_path_buf(), job_name: "j".into() };
    let a = TensorboardMonitor::new(&opts).unwrap();
    let b = TensorboardMonitor::new(&opts).unwrap();
    assert_ne!(a.path(), b.path());
}

#[test]
fn tensorboard_python_reader_if_available() {
    let has_tb = std::process::Command::new("python3")
        .args(["-c", "import tensorboard"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_tb {
        eprintln!("SKIP: python tensorboard not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let opts = TensorboardOpts { output_path: tmp.path().to_path_buf(), job_name: "py".into() };
    let mut tb = TensorboardMonitor::new(&opts).unwrap();
    tb.write(&[Event::new("loss", 1.5, 7), Event::new("loss", 0.75, 8)]).unwrap();
    tb.flush().unwrap();
    let script = "import sys\nfrom tensorboard.backend.event_processing.event_file_loader import EventFileLoader\n\
out=[]\nfor e in EventFileLoader(sys.argv[1]).Load():\n  for v in e.summary.value:\n    \
val = v.simple_value if v.HasField('simple_value') else v.tensor.float_val[0]\n    \
out.append('%s,%d,%g' % (v.tag, e.step, val))\nprint(';'.join(out))\n";
    let out = std::process::Command::new("python3").args(["-c", script, &tb.path().to_string_lossy()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "loss,7,1.5;loss,8,0.75");
}

#[test]
fn csv_monitor_writes_one_file_per_tag_and_appends() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = CsvOpts { output_path: tmp.path().to_path_buf(), job_name: "run".into() };
    let mut m = CsvMonitor::new(&opts).unwrap();
    m.write(&[Event::new("Train/Samples/train_loss", 2.5, 1), Event::new("lr", 0.001, 1)]).unwrap();
    m.write(&[Event::new("Train/Samples/train_loss", 2.25, 2)]).unwrap();
    m.flush().unwrap();
    drop(m);
    let dir = tmp.path().join("run");
    let loss = fs::read_to_string(dir.join("Train_Samples_train_loss.csv")).unwrap();
    assert_eq!(loss, "step,train_loss\n1,2.5\n2,2.25\n");
    assert_eq!(fs::read_to_string(dir.join("lr.csv")).unwrap(), "step,lr\n1,0.001\n");
    // a restarted run appends without repeating the header
    let mut m = CsvMonitor::new(&opts).unwrap();
    m.write(&[Event::new("lr", 0.002, 3)]).unwrap();
    m.flush().unwrap();
    assert_eq!(fs::read_to_string(dir.join("lr.csv")).unwrap(), "step,lr\n1,0.001\n3,0.002\n");
}

#[test]
fn jsonl_monitor_and_set_fan_out() {
    let tmp = tempfile::tempdir().unwrap();
    let jsonl = tmp.path().join("logs").join("metrics.jsonl");
    let config = MonitorConfig {
        tensorboard: Some(TensorboardOpts { output_path: tmp.path().join("tb"), job_name: "j".into() }),
        csv: Some(CsvOpts { output_path: tmp.path().join("csv"), job_name: "j".into() }),
        jsonl: Some(JsonlOpts { path: jsonl.clone() }),
    };
    let mut set = MonitorSet::from_config(&config).unwrap();
    assert_eq!(set.len(), 3);
    set.write(&[Event::new("train/loss", 4.0, 10), Event::new("val/loss", 4.5, 10)]).unwrap();
    set.flush().unwrap();
    let text = fs::read_to_string(&jsonl).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2);
    assert_eq!((lines[1]["step"].as_u64(), lines[1]["tag"].as_str()), (Some(10), Some("val/loss")));
    assert_eq!(lines[0]["value"], 4.0);
    assert!(lines[0]["wall_time"].as_f64().unwrap() > 1.6e9);
    assert!(tmp.path().join("csv/j/val_loss.csv").is_file());
    assert!(MonitorSet::from_config(&MonitorConfig::default()).unwrap().is_empty());
}

#[test]
fn monitor_creation_errors_name_the_path() {
    let tmp = tempfile::tempdir().unwrap();
    let blocker = tmp.path().join("file");
    fs::write(&blocker, b"x").unwrap();
    let opts = CsvOpts { output_path: blocker.clone(), job_name: "j".into() };
    let msg = CsvMonitor::new(&opts).err().unwrap().to_string();
    assert!(msg.contains(&blocker.display().to_string()), "{msg}");
}

/// Minimal well-formedness check: tags balance, attributes quoted, no raw `<`/`&` in text.
fn assert_well_formed(xml: &str) {
    let body = xml.trim_start().strip_prefix("<?xml").and_then(|r| r.split_once("?>")).map_or(xml, |(_, r)| r);
    let mut stack: Vec<String> = Vec::new();
    let mut rest = body;
    while let Some(start) = rest.find('<') {
        let text = &rest[..start];
        assert!(!text.contains('>'), "stray > in text: {text}");
        for (i, _) in text.match_indices('&') {
            assert!(
                text[i..].starts_with("&amp;")
                    || text[i..].starts_with("&lt;")
                    || text[i..].starts_with("&gt;")
                    || text[i..].starts_with("&quot;")
                    || text[i..].starts_with("&apos;")
            );
        }
        let end = rest[start..].find('>').expect("unclosed tag") + start;
        let tag = &rest[start + 1..end];
        assert_eq!(tag.matches('"').count() % 2, 0, "unbalanced quotes in <{tag}>");
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(stack.pop().as_deref(), Some(name.trim()));
        } else if !tag.ends_with('/') {
            stack.push(tag.split_whitespace().next().unwrap().to_string());
        }
        rest = &rest[end + 1..];
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
}

#[test]
fn loss_curve_svg_is_well_formed_and_names_series() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("loss.svg");
    let train: Vec<(u64, f64)> = (0..200).map(|s| (s, 10.0 / (1.0 + s as f64 * 0.05) + 1.0)).collect();
    let val = vec![(0, 11.0), (100, 2.9), (199, f64::NAN), (200, 2.1)];
    write_loss_curve_svg(&path, &[("train <loss>", &train), ("val & test", &val)]).unwrap();
    let svg = fs::read_to_string(&path).unwrap();
    assert_well_formed(&svg);
    assert!(svg.contains("<svg") && svg.contains("train &lt;loss&gt;") && svg.contains("val &amp; test"));
    assert_eq!(svg.matches("<polyline").count(), 2);
    assert!(!svg.contains("NaN") && !svg.contains("inf"));
    // degenerate inputs still give a valid chart
    for series in [vec![], vec![("one", &[(5u64, 1.0f64)][..])]] {
        let p = tmp.path().join("d.svg");
        write_loss_curve_svg(&p, &series).unwrap();
        assert_well_formed(&fs::read_to_string(&p).unwrap());
    }
}
