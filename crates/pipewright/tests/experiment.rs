//! Event-file encoding against published CRC32C check values and a hand-decoded record.

use pipewright::experiment::tfevents::{crc32c, masked_crc, read_records, record, scalars_event};

#[test]
fn crc32c_check_values() {
    // RFC 3720 B.4 and the standard check value.
    assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    assert_eq!(crc32c(&[0xffu8; 32]), 0x62A8_AB43);
    let inc: Vec<u8> = (0..32).collect();
    assert_eq!(crc32c(&inc), 0x46DD_794E);
}

#[test]
fn record_framing_round_trips_and_detects_corruption() {
    let payload = scalars_event(1.5, 7, &[("train/loss", 0.25)]);
    let r = record(&payload);
    assert_eq!(&r[..8], &(payload.len() as u64).to_le_bytes());
    assert_eq!(&r[8..12], &masked_crc(&r[..8]).to_le_bytes());
    assert_eq!(read_records(&r).unwrap(), vec![payload.clone()]);
    let mut bad = r.clone();
    bad[14] ^= 1;
    assert!(read_records(&bad).is_err());
    // Event { wall_time = 1.5 (field 1, fixed64), step = 7 (field 2, varint), summary (field 5) }.
    assert_eq!(payload[0], 0x09);
    assert_eq!(&payload[1..9], &1.5f64.to_le_bytes());
    assert_eq!(&payload[9..11], &[0x10, 7]);
    assert_eq!(payload[11], 0x2a);
    // simple_value 0.25 as a fixed32 after tag 0x15.
    let pos = payload
        .windows(5)
        .position(|w| w[0] == 0x15 && w[1..] == 0.25f32.to_le_bytes())
        .is_some();
    assert!(pos);
}

mod recorder {
    use pipewright::experiment::recorder::FIGURE_SIZE;
    use pipewright::experiment::tfevents::read_records;
    use pipewright::experiment::{LinePlot, Recorder, RgbImage, Stateful};

    fn decode(png: &[u8]) -> (u32, u32, Vec<u8>) {
        let mut r = png::Decoder::new(std::io::Cursor::new(png))
            .read_info()
            .unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        buf.truncate(info.buffer_size());
        (info.width, info.height, buf)
    }

    #[test]
    fn images_figures_scalars_and_the_count_land_in_files_and_events() {
        let dir = std::env::temp_dir().join(format!("pw-rec-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut rec = Recorder::create(&dir, "eval/metric").unwrap();
        rec.scalar("custom/x", 1.5).unwrap();
        rec.step();
        rec.scalar("custom/x", 2.5).unwrap();
        // A 3x2 image with a red pixel at (2, 1).
        let mut img = RgbImage::filled(3, 2, [0, 0, 255]);
        img.put(2, 1, [255, 0, 0]);
        let path = rec.image("pics/tiny", &img).unwrap();
        assert!(path.ends_with("images/pics_tiny-1.png"));
        let plot = LinePlot::new(
            (0..50)
                .map(|i| (i as f64, (i as f64 / 7.0).sin()))
                .collect(),
        );
        let fig = rec.figure("curve", &plot).unwrap();
        rec.params(&serde_json::json!({"lr": 0.1, "name": "a", "deep": true}))
            .unwrap();
        rec.flush().unwrap();

        // The image file decodes to the pixels given.
        let (w, h, px) = decode(&std::fs::read(&path).unwrap());
        assert_eq!((w, h), (3, 2));
        assert_eq!(&px[15..18], &[255, 0, 0]);
        assert_eq!(&px[..3], &[0, 0, 255]);
        // The figure is the figure size, with the curve's colour in it.
        let (w, h, px) = decode(&std::fs::read(&fig).unwrap());
        assert_eq!((w, h), FIGURE_SIZE);
        assert!(px.chunks(3).any(|p| p == [78, 121, 167]));
        // The events file holds both PNGs as image summaries (tag, then the bytes).
        let events = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().contains("tfevents"))
            .unwrap();
        let records = read_records(&std::fs::read(events).unwrap()).unwrap();
        let holds = |needle: &[u8]| {
            records
                .iter()
                .any(|r| r.windows(needle.len()).any(|w| w == needle))
        };
        assert!(holds(&std::fs::read(&path).unwrap()) && holds(&std::fs::read(&fig).unwrap()));
        assert!(holds(b"pics/tiny") && holds(b"_hparams_/session_start_info") && holds(b"hparams"));
        // Scalars by tag at the counts they were recorded at.
        let tags = std::fs::read_to_string(dir.join("tags.csv")).unwrap();
        assert_eq!(tags, "count,tag,value\n0,custom/x,1.5\n1,custom/x,2.5\n");
        let hp: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("hparams.json")).unwrap())
                .unwrap();
        assert_eq!(hp["lr"], 0.1);
        // The count is state: a restored recorder goes on from it.
        let state = rec.state_dict().unwrap();
        let mut again = Recorder::resume(&dir, "eval/metric", 1).unwrap();
        again.load_state_dict(&state).unwrap();
        assert_eq!(again.count(), 1);
        let tags = std::fs::read_to_string(dir.join("tags.csv")).unwrap();
        assert_eq!(
            tags, "count,tag,value\n0,custom/x,1.5\n",
            "rows from the resumed count on go"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
