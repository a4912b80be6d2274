//! Schedules as files through the command line: `schedule --save` writes one, a legal edit
//! trains to the built schedule's losses, and an illegal edit, a schedule for another
//! pipeline, or a --save over a file that is no schedule are refused before anything is
//! written.

mod common;

use common::{losses, refused, run, text, tmp, TINY};

/// `text` with the actions `a` and `b` of rank `r` swapped.
fn swapped(text: &str, r: usize, a: &str, b: &str) -> String {
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    let mut acts: Vec<&str> = lines[r].split(',').collect();
    let i = acts.iter().position(|x| *x == a).unwrap();
    let j = acts.iter().position(|x| *x == b).unwrap();
    acts.swap(i, j);
    lines[r] = acts.join(",");
    lines.join("\n") + "\n"
}

#[test]
fn a_saved_schedule_edited_trains_and_bad_ones_are_refused() {
    let dir = tmp("schedule-file");
    std::fs::create_dir_all(&dir).unwrap();
    let path = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let saved = path("zbv.csv");
    let o = run(&[
        "schedule",
        "--schedule",
        "zbv",
        "--pp",
        "2",
        "--chunks",
        "4",
        "--save",
        &saved,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let csv = std::fs::read_to_string(&saved).unwrap();
    assert_eq!(csv.lines().count(), 2, "{csv}");
    let train = |extra: &[&str], out: &str| {
        let mut args = vec!["train", "--pp", "2", "--chunks", "4", "--steps", "3"];
        // Two blocks: four units, one per stage of the V.
        args.extend(TINY);
        args.extend(["--n-layer", "2"]);
        args.extend(extra);
        args.extend(["--out", out]);
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let ok = |args: Vec<String>| {
        let o = run(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{}", text(&o));
    };
    // A legal edit: rank 0's weight pass of micro-batch 0 on stage 3 after the next forward.
    let edited = path("edited.csv");
    std::fs::write(&edited, swapped(&csv, 0, "3W0", "3F1")).unwrap();
    ok(train(&["--schedule", "zbv"], &path("built")));
    ok(train(&["--schedule-file", &edited], &path("edited")));
    // The record names the file that ran (--schedule's default, which it replaced, stays).
    let params: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("edited").join("params.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(params["schedule_file"], edited.as_str());
    let (a, b) = (losses(&dir.join("built")), losses(&dir.join("edited")));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!(((x - y) / x).abs() < 1e-9, "built {a:?} edited {b:?}");
    }
    // An illegal edit: rank 1 would wait for its own forward.
    let bad = path("bad.csv");
    std::fs::write(&bad, swapped(&csv, 1, "2F0", "2I0")).unwrap();
    let args = train(&["--schedule-file", &bad], &path("never"));
    refused(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "rank 1 at 2I0 waits for forward of micro-batch 0",
    );
    assert!(
        !dir.join("never").exists(),
        "a refused run wrote its directory"
    );
    // A schedule made for another pipeline.
    let mut args = train(&["--schedule-file", &saved], &path("never"));
    args[2] = "4".into();
    refused(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        "the given schedule has 2 ranks",
    );
    // --save over a file that is not a schedule.
    let other = path("notes.txt");
    std::fs::write(&other, "my notes\n").unwrap();
    refused(
        &["schedule", "--schedule", "zbv", "--save", &other],
        "already exists and is not a saved schedule",
    );
    assert_eq!(std::fs::read_to_string(&other).unwrap(), "my notes\n");
    std::fs::remove_dir_all(&dir).unwrap();
}
