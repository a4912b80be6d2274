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

/// A value as a table shows it: strings bare, numbers as written, the rest as JSON.
pub fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "–".into(),
        v => v.to_string(),
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
        let mut row = vec![k.clone()];
        row.extend(
            maps.iter()
                .map(|m| m.get(k).map_or(String::new(), value_text)),
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
