//! The report page: written by `train --report` and `pipewright report`, rendered by a real
//! browser (headless Chromium, which `.ci/run` installs) with no script error, every section
//! there and the run's own numbers in it; and what it says of bad input.

use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_pipewright")
}

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(bin())
        .args(args)
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-report-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Headless Chromium, if installed (`tools/install-chromium.sh`).
fn browser() -> Option<&'static str> {
    ["chromium-headless-shell", "chromium", "chromium-browser"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

/// The page's DOM after its script ran, and a screenshot of it at `shot`.
fn render(browser: &str, page: &Path, shot: &Path) -> String {
    let url = format!("file://{}", page.canonicalize().unwrap().display());
    let flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--virtual-time-budget=5000",
    ];
    let dom = Command::new(browser)
        .args(flags)
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .unwrap();
    assert!(
        dom.status.success(),
        "{}",
        String::from_utf8_lossy(&dom.stderr)
    );
    let shot_arg = format!("--screenshot={}", shot.display());
    let s = Command::new(browser)
        .args(flags)
        .args(["--window-size=1400,2600", &shot_arg, &url])
        .output()
        .unwrap();
    assert!(
        s.status.success() && shot.exists(),
        "{}",
        String::from_utf8_lossy(&s.stderr)
    );
    String::from_utf8_lossy(&dom.stdout).into_owned()
}

#[test]
fn a_runs_page_renders_in_a_browser_with_its_own_numbers() {
    let out = tmp("run");
    let o = out.to_str().unwrap();
    let trace = out.join("trace.json");
    let (ok, text) = run(&[
        "train",
        "--pp",
        "2",
        "--chunks",
        "4",
        "--steps",
        "12",
        "--eval-every",
        "6",
        "--trace",
        trace.to_str().unwrap(),
        "--report",
        "--out",
        o,
    ]);
    assert!(ok, "{text}");
    let page = out.join("report.html");
    let html = std::fs::read_to_string(&page).unwrap();
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let final_loss = summary["final_loss"].to_string();
    assert!(
        html.contains(&final_loss),
        "the summary's final loss {final_loss} is on the page"
    );
    // The last logged loss is the summary's, at step 12 (one numbering).
    let last = std::fs::read_to_string(out.join("scalars.csv")).unwrap();
    let last = last.lines().last().unwrap().to_string();
    assert!(last.starts_with("12,"), "{last}");
    assert_eq!(
        last.split(',').nth(1).unwrap().parse::<f64>().unwrap(),
        summary["final_loss"].as_f64().unwrap()
    );
    // Measured above predicted, two stages each.
    assert!(html.contains("measured (last traced step)") && html.contains("predicted"));

    let Some(browser) = browser() else {
        assert!(
            std::env::var("CI").is_err(),
            "CI installs headless Chromium: none found"
        );
        eprintln!("no headless Chromium here (tools/install-chromium.sh): page not rendered");
        return;
    };
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report-screenshot.png");
    let dom = render(browser, &page, &shot);
    assert!(
        dom.contains("data-rendered=\"yes\""),
        "the page's script ran to its end"
    );
    let errors = dom
        .split("id=\"js-errors\"")
        .nth(1)
        .and_then(|r| r.split_once('>'))
        .map(|(_, r)| r.split('<').next().unwrap_or(""))
        .unwrap();
    assert!(errors.trim().is_empty(), "script errors: {errors}");
    for id in [
        "summary",
        "curves",
        "throughput",
        "timeline",
        "memory",
        "launch",
        "parameters",
    ] {
        assert!(
            dom.contains(&format!("id=\"{id}\"")),
            "section {id} rendered"
        );
    }
    assert!(dom.contains(&final_loss));
    // Every chart has its series' points to show under the pointer, and axes with labels.
    assert!(
        dom.matches("class=\"series\"").count() >= 5,
        "loss, lr, metric, throughput, MFU"
    );
    assert!(dom.contains("loss (log scale)"));
    eprintln!("screenshot: {}", shot.display());
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn the_page_says_what_is_missing() {
    let base = tmp("bad");
    std::fs::create_dir_all(base.join("not-a-run")).unwrap();
    let run_dir = base.join("run");
    let (ok, text) = run(&["train", "--steps", "3", "--out", run_dir.to_str().unwrap()]);
    assert!(ok, "{text}");
    // A run still in progress: no summary yet.
    std::fs::remove_file(run_dir.join("summary.json")).unwrap();
    let page = base.join("page.html");
    let (ok, text) = run(&[
        "report",
        run_dir.to_str().unwrap(),
        "--out",
        page.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("still in progress"));
    assert!(html.contains("no trace"));
    assert!(text.contains("no trace"), "{text}");
    // A directory that is not a run is an error (it said so and exited 0), and no page is
    // written.
    let (ok, text) = run(&[
        "report",
        base.join("not-a-run").to_str().unwrap(),
        run_dir.to_str().unwrap(),
        "--out",
        base.join("bad.html").to_str().unwrap(),
    ]);
    assert!(!ok && text.contains("is not a run"), "{text}");
    assert!(!text.contains("still in progress"), "{text}");
    assert!(!base.join("bad.html").exists());
    // A path that is not a directory is an error, and no page is written.
    let none = base.join("nowhere");
    let other = base.join("other.html");
    let (ok, text) = run(&[
        "report",
        none.to_str().unwrap(),
        "--out",
        other.to_str().unwrap(),
    ]);
    assert!(!ok && text.contains("is not a directory"), "{text}");
    assert!(!other.exists());
    std::fs::remove_dir_all(&base).unwrap();
}
