//! The page's HTML pieces: escaping, tables of values, and the page around the sections with
//! its style and the small script that shows values under the pointer (no network: everything
//! is inline).

use std::fmt::Write;

use serde_json::{Map, Value};

/// `text` safe inside HTML text and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A value as a table shows it: strings bare, whole numbers as written, other numbers to five
/// significant digits, lists and maps item by item.
pub fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "–".into(),
        Value::Number(n) if n.is_f64() => n.as_f64().map_or_else(|| n.to_string(), significant),
        Value::Array(a) => a.iter().map(value_text).collect::<Vec<_>>().join(", "),
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| format!("{k} {}", value_text(v)))
            .collect::<Vec<_>>()
            .join(", "),
        v => v.to_string(),
    }
}

/// `key`'s value as the summary and parameter tables show it: sizes in bytes (keys ending in
/// `bytes`) in binary units, bubbles (keys naming one) as percentages, the rest as
/// [`value_text`].
pub fn cell_text(key: &str, v: &Value) -> String {
    let each = |f: &dyn Fn(f64) -> String| match v {
        Value::Number(n) => n.as_f64().map(f),
        Value::Array(a) if a.iter().all(Value::is_number) => Some(
            a.iter()
                .filter_map(Value::as_f64)
                .map(f)
                .collect::<Vec<_>>()
                .join(", "),
        ),
        _ => None,
    };
    let shown = if key.ends_with("bytes") {
        each(&crate::runtime::bytes::format_bytes)
    } else if key.contains("bubble") {
        each(&|b| format!("{:.1} %", b * 100.0))
    } else {
        None
    };
    shown.unwrap_or_else(|| value_text(v))
}

/// `v` to five significant digits, trailing zeros dropped (3333.3, 0.11670, 1.5518).
fn significant(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return v.to_string();
    }
    let digits = (4 - v.abs().log10().floor() as i32).clamp(0, 12) as usize;
    let s = format!("{v:.digits$}");
    match s.contains('.') {
        true => s.trim_end_matches('0').trim_end_matches('.').to_string(),
        false => s,
    }
}

/// What a key of the summary is called in its table, where the name alone would mislead.
fn key_label(key: &str) -> String {
    match key {
        "bubble_per_stage" => {
            "bubble_per_stage (share of all steps' time each stage waited)".into()
        }
        k => k.to_string(),
    }
}

/// A table of rows of cells; the first row is the header. Each cell is text (escaped here).
pub fn table(class: &str, rows: &[Vec<String>]) -> String {
    let mut s = format!("<table class=\"{class}\">");
    for (i, row) in rows.iter().enumerate() {
        let cell = if i == 0 { "th" } else { "td" };
        s.push_str("<tr>");
        for c in row {
            let _ = write!(s, "<{cell}>{}</{cell}>", escape(c));
        }
        s.push_str("</tr>");
    }
    s.push_str("</table>");
    s
}

/// Key-value rows of `maps` side by side, one column per map (a sweep's runs' parameters),
/// every key any of them has.
pub fn key_table(class: &str, names: &[String], maps: &[&Map<String, Value>]) -> String {
    let mut keys: Vec<&String> = maps.iter().flat_map(|m| m.keys()).collect();
    keys.sort();
    keys.dedup();
    let mut rows = vec![std::iter::once(String::new())
        .chain(names.iter().cloned())
        .collect::<Vec<_>>()];
    for k in keys {
        let mut row = vec![key_label(k)];
        row.extend(
            maps.iter()
                .map(|m| m.get(k).map_or(String::new(), |v| cell_text(k, v))),
        );
        rows.push(row);
    }
    table(class, &rows)
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}\
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}\
table{border-collapse:collapse;font-size:13px;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}\
th{background:#f4f4f4}.charts{display:flex;flex-wrap:wrap;gap:12px}\
svg.chart{border:1px solid #eee;background:#fff}svg .axis{stroke:#444}svg .grid{stroke:#eee}\
svg .tick,svg .legend{font-size:11px;fill:#444}svg .label{font-size:12px;fill:#222}\
svg .title{font-size:14px;fill:#222}svg .cursor{stroke:#999;stroke-dasharray:3 3}\
.missing{color:#a33}#tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #999;\
padding:4px 6px;font-size:12px;display:none;white-space:pre}.timeline{overflow-x:auto}";

/// Shows the values of every series at the pointer's step; reports script errors on the page.
const SCRIPT: &str = r#"
window.onerror=function(m){var e=document.getElementById('js-errors');e.textContent+=m+'\n';e.style.display='block';};
(function(){
var tip=document.getElementById('tip');
document.querySelectorAll('svg.chart').forEach(function(svg){
  var x0=+svg.dataset.x0,x1=+svg.dataset.x1,l=+svg.dataset.left,r=+svg.dataset.right;
  var lines=[].slice.call(svg.querySelectorAll('polyline.series')).map(function(p){
    return {name:p.dataset.name,pts:JSON.parse(p.dataset.points)};});
  var cur=svg.querySelector('.cursor');
  svg.addEventListener('mousemove',function(ev){
    var b=svg.getBoundingClientRect(),px=(ev.clientX-b.left)*svg.viewBox.baseVal.width/b.width;
    var x=x0+(px-l)/(r-l)*(x1-x0),text=[];
    lines.forEach(function(s){var best=null;s.pts.forEach(function(p){
      if(best===null||Math.abs(p[0]-x)<Math.abs(best[0]-x))best=p;});
      if(best)text.push(s.name+': '+best[1].toPrecision(5)+' at '+best[0]);});
    cur.setAttribute('x1',px);cur.setAttribute('x2',px);cur.setAttribute('visibility','visible');
    tip.textContent=text.join('\n');tip.style.display='block';
    tip.style.left=(ev.clientX+12)+'px';tip.style.top=(ev.clientY+12)+'px';});
  svg.addEventListener('mouseleave',function(){tip.style.display='none';cur.setAttribute('visibility','hidden');});
});
document.body.dataset.rendered='yes';
})();
"#;

/// The tag that marks a page as this module's ([`is_page`]).
const GENERATOR: &str = "<meta name=\"generator\" content=\"pipewright report\">";

/// Whether `text` is a page [`page`] wrote (which `pipewright report --out` may replace); pages
/// from before the generator tag are known by their error box.
pub fn is_page(text: &str) -> bool {
    text.starts_with("<!DOCTYPE html>")
        && (text.contains(GENERATOR) || text.contains("<pre id=\"js-errors\""))
}

/// The whole page: `title`, then `body` (the sections), the tooltip and the script.
pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">{GENERATOR}\
         <title>{t}</title><style>{STYLE}</style></head><body>\
         <h1>{t}</h1><pre id=\"js-errors\" class=\"missing\" style=\"display:none\"></pre>\
         {body}<div id=\"tip\"></div><script>{SCRIPT}</script></body></html>\n",
        t = escape(title)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The summary table shows sizes in binary units, bubbles in per cent and fractions to
    /// five significant digits, not raw bytes and 16-digit floats.
    #[test]
    fn summary_cells_are_readable() {
        assert_eq!(cell_text("peak_memory_bytes", &json!(95444992)), "91.0 MiB");
        assert_eq!(
            cell_text(
                "rank_training_peak_allocated_bytes",
                &json!([1048576, 3221225472u64])
            ),
            "1.0 MiB, 3.0 GiB"
        );
        assert_eq!(
            cell_text("bubble_per_stage", &json!([0.32, 0.000619])),
            "32.0 %, 0.1 %"
        );
        assert_eq!(
            cell_text("final_loss", &json!(1.5518124103546143)),
            "1.5518"
        );
        assert_eq!(
            cell_text("items_per_second", &json!(3333.304477391004)),
            "3333.3"
        );
        assert_eq!(
            cell_text("median_step_seconds", &json!(0.116696562)),
            "0.1167"
        );
        assert_eq!(cell_text("steps", &json!(100)), "100");
        assert_eq!(
            cell_text(
                "median_step_parts",
                &json!({"pipeline_s": 0.06804436, "update_s": 0.004244614})
            ),
            "pipeline_s 0.068044, update_s 0.0042446"
        );
        let table = key_table(
            "summary",
            &["a".into()],
            &[json!({"bubble_per_stage": [0.5]}).as_object().unwrap()],
        );
        assert!(
            table.contains("all steps"),
            "the summary's bubble says what it is: {table}"
        );
    }
}
