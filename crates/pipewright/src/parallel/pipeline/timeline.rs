//! What a simulated (or measured) step is: every action placed in time ([`Span`]), the
//! makespan, the bubble and the activations each rank holds ([`Simulation`]), the costs the
//! simulator is given ([`Costs`]), and the timeline pictures (text or SVG).

use super::schedule::{Action, Schedule};

/// Durations of the actions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// Seconds of a forward.
    pub forward: f64,
    /// Seconds of a full backward.
    pub backward: f64,
    /// Seconds of an input-gradient action.
    pub backward_input: f64,
    /// Seconds of a weight-gradient action.
    pub backward_weight: f64,
}

impl Costs {
    /// Forward 1, full backward 2 (its input and weight halves 1 each).
    pub fn unit() -> Self {
        Self {
            forward: 1.0,
            backward: 2.0,
            backward_input: 1.0,
            backward_weight: 1.0,
        }
    }

    pub(super) fn of(&self, a: &Action) -> f64 {
        match a {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward,
            Action::BackwardInput { .. } => self.backward_input,
            Action::BackwardWeight { .. } => self.backward_weight,
        }
    }
}

/// An action placed in time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// When it starts.
    pub start: f64,
    /// When it ends.
    pub end: f64,
    /// What it is.
    pub action: Action,
}

/// What a rank holds as one of its actions starts: the micro-batches whose forward it has run
/// and whose backward (a split backward's input pass) it has not, so it keeps their
/// activations, counting the one a backward works on; and the micro-batches whose input pass
/// has run and whose weight pass has not, so it keeps their queued weight-gradient work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Micro-batches whose activations the rank keeps.
    pub graphs: usize,
    /// Micro-batches whose weight-gradient queue the rank keeps (split backwards only).
    pub queues: usize,
}

/// Per rank of `s`, what it holds as each of its actions starts (in its order): where its
/// memory peaks is one of these, inside the action that starts there.
pub fn held(s: &Schedule) -> Vec<Vec<Held>> {
    s.actions
        .iter()
        .map(|list| {
            let mut now = Held::default();
            list.iter()
                .map(|a| {
                    let at = now;
                    match a {
                        Action::Forward { .. } => now.graphs += 1,
                        Action::Backward { .. } => now.graphs -= 1,
                        Action::BackwardInput { .. } => {
                            now.graphs -= 1;
                            now.queues += 1;
                        }
                        Action::BackwardWeight { .. } => now.queues -= 1,
                    }
                    at
                })
                .collect()
        })
        .collect()
}

/// The share of `ranks` ranks' time over `makespan` seconds not among the `busy` seconds they
/// computed (0 for an empty step).
pub(super) fn idle_share(busy: f64, ranks: usize, makespan: f64) -> f64 {
    if makespan > 0.0 {
        1.0 - busy / (ranks as f64 * makespan)
    } else {
        0.0
    }
}

/// A simulated run of a schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// Per stage, its actions in time.
    pub spans: Vec<Vec<Span>>,
    /// When the last action ends.
    pub makespan: f64,
    /// Idle share of stage-time: 1 - busy / (stages * makespan).
    pub bubble: f64,
    /// Per stage, the most micro-batches it holds at once, from their forward until their
    /// backward is done (a split backward's weight pass).
    pub peak_in_flight: Vec<usize>,
}

impl Simulation {
    /// The simulation of `s` whose actions took `spans` (per rank, in order), ending at
    /// `makespan`: its bubble and the micro-batches each rank holds at once.
    pub(super) fn from_spans(s: &Schedule, spans: Vec<Vec<Span>>, makespan: f64) -> Self {
        let busy: f64 = spans.iter().flatten().map(|s| s.end - s.start).sum();
        let bubble = idle_share(busy, s.ranks, makespan);
        // (A rank's last action is a backward: what it holds after it is never the most.)
        let peak_in_flight = held(s)
            .iter()
            .map(|h| h.iter().map(|h| h.graphs + h.queues).max().unwrap_or(0))
            .collect();
        Simulation {
            spans,
            makespan,
            bubble,
            peak_in_flight,
        }
    }

    /// One row per rank, one cell per time unit (costs must be whole numbers).
    pub fn timeline(&self) -> String {
        let width = self
            .spans
            .iter()
            .flatten()
            .map(|s| s.action.to_string().len())
            .max()
            .unwrap_or(2)
            .max(2);
        let cells = self.makespan.ceil() as usize;
        let mut out = String::new();
        for (r, row) in self.spans.iter().enumerate() {
            let mut line = vec![format!("{:>w$}", ".", w = width); cells];
            for s in row {
                let label = format!("{:>w$}", s.action.to_string(), w = width);
                for cell in &mut line[s.start as usize..s.end.ceil() as usize] {
                    cell.clone_from(&label);
                }
            }
            out.push_str(&format!("rank {r:>2} |{}\n", line.join(" ")));
        }
        out
    }

    /// The timeline as an SVG picture, one time unit 28 pixels wide.
    pub fn svg(&self, title: &str) -> String {
        svg_panels(&[(title, self)], 28.0)
    }

    /// Each stage's idle share of the step: 1 - its busy time / the makespan.
    pub fn idle_per_stage(&self) -> Vec<f64> {
        self.spans
            .iter()
            .map(|row| {
                let busy: f64 = row.iter().map(|s| s.end - s.start).sum();
                if self.makespan > 0.0 {
                    1.0 - busy / self.makespan
                } else {
                    0.0
                }
            })
            .collect()
    }
}

/// The narrowest an action is drawn, in pixels, however short it is.
const MIN_BOX_PX: f64 = 2.0;

/// The width of a character of the timelines' 11-pixel monospace labels (0.6 em).
const CHAR_PX: f64 = 6.6;

/// [`svg_panels`] with the longest timeline `width` pixels wide, for timelines in seconds (a
/// measured trace, a prediction): its time axis in milliseconds.
pub fn svg_panels_wide(panels: &[(&str, &Simulation)], width: f64) -> String {
    let longest = panels.iter().map(|p| p.1.makespan).fold(0.0, f64::max);
    let unit = if longest > 0.0 { width / longest } else { 1.0 };
    draw(panels, unit, (1000.0, "ms"))
}

/// The description that marks a picture as [`svg_panels`]'s ([`is_timeline_svg`]).
const SVG_DESC: &str = "pipewright pipeline timelines";

/// Whether `text` is a picture [`svg_panels`] drew (which `schedule --svg` may replace);
/// pictures from before the description are known by their opening tag.
pub fn is_timeline_svg(text: &str) -> bool {
    text.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\"")
        && (text.contains(SVG_DESC) || text.contains("font-family=\"monospace\" font-size=\"11\""))
}

/// Timelines stacked in one SVG picture on one time scale, `unit` pixels per time unit (a
/// prediction above a measured trace, say): each panel its title and bubble, then a row per
/// stage with a box per action; a time axis (in the schedule's time units) under them.
pub fn svg_panels(panels: &[(&str, &Simulation)], unit: f64) -> String {
    draw(panels, unit, (1.0, "time units"))
}

/// Height of the time axis under the panels, in pixels.
const AXIS_PX: f64 = 32.0;

/// [`svg_panels`] with its axis labelled `name`, a time unit being `per` of the label's.
fn draw(panels: &[(&str, &Simulation)], unit: f64, (per, name): (f64, &str)) -> String {
    let (row, head, left) = (30.0, 34.0, 70.0);
    let longest = panels.iter().map(|p| p.1.makespan).fold(0.0, f64::max);
    let w = left + longest * unit + 10.0;
    let h: f64 = panels
        .iter()
        .map(|p| head + p.1.spans.len() as f64 * row + 10.0)
        .sum::<f64>()
        + AXIS_PX;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"monospace\" font-size=\"11\">\n\
         <desc>{SVG_DESC}</desc>\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    );
    let mut top = 0.0;
    for (title, sim) in panels {
        s.push_str(&format!(
            "<text x=\"8\" y=\"{}\" font-size=\"13\">{title} — bubble {:.1} %</text>\n",
            top + 20.0,
            sim.bubble * 100.0
        ));
        top += head;
        for (r, spans) in sim.spans.iter().enumerate() {
            let y = top + r as f64 * row;
            s.push_str(&format!(
                "<text x=\"8\" y=\"{}\">stage {r}</text>\n",
                y + row * 0.6
            ));
            for sp in spans {
                let color = match sp.action {
                    Action::Forward { .. } => "#4e79a7",
                    Action::Backward { .. } => "#e15759",
                    Action::BackwardInput { .. } => "#f28e2b",
                    Action::BackwardWeight { .. } => "#59a14f",
                };
                let x = left + sp.start * unit;
                let wd = (sp.end - sp.start) * unit;
                // A near-empty action (an embedding's stage) still shows, without the white
                // edge that would hide it; its name is shown under the pointer, and written
                // in the box only where it fits (it overlapped the next box's name).
                let drawn = (wd - 1.0).max(MIN_BOX_PX);
                let edge = if drawn > 2.0 * MIN_BOX_PX {
                    " stroke=\"white\""
                } else {
                    ""
                };
                let name = sp.action.to_string();
                s.push_str(&format!(
                    "<rect x=\"{x}\" y=\"{y}\" width=\"{drawn}\" height=\"{}\" fill=\"{color}\"{edge}>\
                     <title>{name}</title></rect>",
                    row - 4.0,
                ));
                if drawn >= name.len() as f64 * CHAR_PX + 4.0 {
                    s.push_str(&format!(
                        "<text x=\"{}\" y=\"{}\" fill=\"white\" text-anchor=\"middle\">{name}</text>",
                        x + drawn / 2.0,
                        y + row * 0.6,
                    ));
                }
                s.push('\n');
            }
        }
        top += sim.spans.len() as f64 * row + 10.0;
    }
    s.push_str(&time_axis(top, left, longest, unit, (per, name)));
    s.push_str("</svg>\n");
    s
}

/// The axis under the panels at `top`: a line from `left` over `longest` time units, round
/// ticks labelled in `name` (a time unit `per` of them).
fn time_axis(top: f64, left: f64, longest: f64, unit: f64, (per, name): (f64, &str)) -> String {
    let y = top + 4.0;
    let mut s = format!(
        "<line x1=\"{left}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#444\"/>\n\
         <text x=\"8\" y=\"{}\">{name}</text>\n",
        left + longest * unit,
        y + 16.0
    );
    if longest > 0.0 {
        for t in crate::runtime::axis::linear_ticks(0.0, longest * per, 8) {
            let x = left + t / per * unit;
            s.push_str(&format!(
                "<line x1=\"{x}\" y1=\"{y}\" x2=\"{x}\" y2=\"{}\" stroke=\"#444\"/>\
                 <text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                y + 5.0,
                y + 18.0,
                crate::runtime::axis::tick_label(t)
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Timelines have a time axis: round ticks in milliseconds for a measured (seconds)
    /// timeline, in schedule units for a schedule's.
    #[test]
    fn timelines_have_a_time_axis() {
        let sim = Simulation {
            spans: vec![vec![Span {
                start: 0.0,
                end: 0.012,
                action: Action::Forward { mb: 0, stage: 0 },
            }]],
            makespan: 0.012,
            bubble: 0.0,
            peak_in_flight: vec![1],
        };
        let svg = svg_panels_wide(&[("measured", &sim)], 600.0);
        assert!(svg.contains(">ms</text>"), "{svg}");
        for t in ["0", "2", "6", "12"] {
            assert!(
                svg.contains(&format!("text-anchor=\"middle\">{t}</text>")),
                "tick {t}: {svg}"
            );
        }
        let units = svg_panels(&[("schedule", &sim)], 28.0);
        assert!(units.contains(">time units</text>"), "{units}");
    }

    #[test]
    fn a_short_action_shows_and_no_name_spills_out_of_its_box() {
        let span = |start: f64, end: f64, mb: usize| Span {
            start,
            end,
            action: Action::Forward { mb, stage: 0 },
        };
        // At 100 pixels a unit: a 0.001-unit forward (0.1 px) and a 1-unit one (100 px).
        let sim = Simulation {
            spans: vec![vec![span(0.0, 0.001, 0), span(0.001, 1.001, 1)]],
            makespan: 1.001,
            bubble: 0.0,
            peak_in_flight: vec![1],
        };
        let svg = svg_panels(&[("t", &sim)], 100.0);
        let rects: Vec<&str> = svg.split("<rect").skip(2).collect();
        assert_eq!(rects.len(), 2, "{svg}");
        assert!(
            rects[0].contains(&format!("width=\"{MIN_BOX_PX}\"")),
            "{svg}"
        );
        // Both name themselves under the pointer; only the wide one in its box.
        assert!(rects[0].contains("<title>0F0</title>") && rects[1].contains("<title>0F1</title>"));
        assert!(
            !svg.contains(">0F0</text>") && svg.contains(">0F1</text>"),
            "{svg}"
        );
    }
}
