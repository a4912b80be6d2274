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
