// optdrift dashboard: progress polling (the JSON API) and plotly charts. No build step.
"use strict";
const optdrift = (() => {
  const FINAL = new Set(["done", "failed", "cancelled", "error"]);  // service.db.models.FINAL_STATUSES
  const POLL_MS = 2000;
  const SIGNIFICANT_DIGITS = 4;  // service.core.wording.SIGNIFICANT_DIGITS

  // service.core.wording.number, mirrored: `digits` significant digits and the power of ten always
  // written (1.255e-02), 0, NaN, +inf, -inf, `missing` for null. tests/test_wording.py runs both on
  // one table of values and checks they agree.
  function number(value, digits = SIGNIFICANT_DIGITS, missing = "—") {
    if (value === null || value === undefined) return missing;
    const x = Number(value);
    if (Number.isNaN(x)) return "NaN";
    if (!Number.isFinite(x)) return x > 0 ? "+inf" : "-inf";
    if (x === 0) return "0";
    const places = Math.max(1, digits) - 1;
    let [mantissa, exponent] = x.toExponential(places).split("e");
    // Python rounds an exact tie to the even digit, toExponential away from zero: where the exact
    // decimal expansion is a tie and the digit kept is even, keep the truncated digits.
    const [exactMantissa, exactExponent] = x.toExponential(100).split("e");
    const exactDigits = exactMantissa.replace("-", "").replace(".", "");
    if (/^50*$/.test(exactDigits.slice(places + 1)) && Number(exactDigits[places]) % 2 === 0) {
      const kept = exactDigits.slice(0, places + 1);
      mantissa = (x < 0 ? "-" : "") + kept[0] + (places ? "." + kept.slice(1) : "");
      exponent = exactExponent;
    }
    const power = Number(exponent);
    return `${mantissa}e${power < 0 ? "-" : "+"}${String(Math.abs(power)).padStart(2, "0")}`;
  }
  const numbers = (values) => values.map((v) => number(v));

  async function getJSON(url) {
    const response = await fetch(url, { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    return response.json();
  }

  // Overview: rows of unfinished runs poll their run; when one finishes, reload to show its verdict.
  function pollOverview() {
    const rows = [...document.querySelectorAll("tr[data-poll-run]")];
    if (!rows.length) return;
    const tick = async () => {
      let finished = false;
      for (const row of rows) {
        try {
          const run = await getJSON(`/api/v1/runs/${row.dataset.pollRun}`);
          const badge = row.querySelector(".badge");
          const p = run.progress;
          badge.textContent = run.status + (run.status === "running" && p.cases_total ? ` ${p.cases_done}/${p.cases_total}` : "");
          if (FINAL.has(run.status)) finished = true;
        } catch (error) { console.warn(error.message); }
      }
      if (finished) window.location.reload(); else setTimeout(tick, POLL_MS);
    };
    setTimeout(tick, POLL_MS);
  }

  // Run page: progress while the run goes; then reload for the verdict. Plots of changed cases.
  function runPage() {
    const head = document.getElementById("run");
    if (head && head.dataset.final !== "true") pollRun(head.dataset.runId);
    const panels = document.getElementById("divergence-data");
    if (panels) smallMultiples(JSON.parse(panels.textContent));
    const training = document.getElementById("training-data");
    if (training) trainingPanels(JSON.parse(training.textContent));
    const trainingJob = document.querySelector("[data-poll-training]");
    if (trainingJob) pollTraining(trainingJob.dataset.pollTraining);
    const plot = document.getElementById("ref-plot");
    if (plot) plotCase(plot.dataset.case);
    for (const button of document.querySelectorAll(".plot-button")) {
      button.addEventListener("click", () => {
        plotCase(button.dataset.case, button.dataset.name);
        document.getElementById("ref-plot").scrollIntoView({ behavior: "smooth" });
      });
    }
  }

  function pollRun(runId) {
    const tick = async () => {
      try {
        const run = await getJSON(`/api/v1/runs/${runId}`);
        const p = run.progress;
        const bar = document.getElementById("progress-bar");
        const text = document.getElementById("progress-text");
        if (p.build) {  // while it builds: the build's own progress, in the API's words
          if (bar) { bar.max = p.build.total || 1; bar.value = p.build.done || 0; }
          if (text) text.textContent = p.build.text;
        } else {
          if (bar) { bar.max = p.cases_total || 1; bar.value = p.cases_done; }
          if (text) text.textContent = `${run.status}: ${p.cases_done} of ${p.cases_total ?? "?"} cases`;
        }
        const status = document.getElementById("run-status");
        if (status) status.textContent = run.status;
        if (FINAL.has(run.status)) { window.location.reload(); return; }
      } catch (error) { console.warn(error.message); }
      setTimeout(tick, POLL_MS);
    };
    setTimeout(tick, POLL_MS);
  }

  const steps = (values) => values.map((_, i) => i + 1);
  const layout = (title, yTitle) => ({
    title: { text: title, font: { size: 14 } }, margin: { l: 64, r: 12, t: 36, b: 44 },
    xaxis: { title: { text: "step" } }, yaxis: { type: "log", title: { text: yTitle }, exponentformat: "e" },
    legend: { orientation: "h", y: -0.25 }, autosize: true,
  });
  const config = { responsive: true, displaylogo: false };
  // Hover text: the step and the value as service.core.wording.number writes it (customdata).
  const HOVER = "step %{x}: %{customdata}<extra>%{fullData.name}</extra>";

  // `name`: the case named by what it is (the heading shows it; the id with its hash is its tooltip).
  async function plotCase(caseId, name) {
    const target = document.getElementById("ref-plot");
    const data = await getJSON(`${target.dataset.seriesUrl}?case=${encodeURIComponent(caseId)}`);
    const heading = document.getElementById("plot-case");
    if (name) { heading.textContent = name; heading.title = caseId; }
    const traces = [{ name: "this commit", x: steps(data.commit.ref64_max_abs), y: data.commit.ref64_max_abs,
                      customdata: numbers(data.commit.ref64_max_abs), hovertemplate: HOVER,
                      mode: "lines", line: { color: "#cf222e", width: 2 } }];
    if (data.baseline) {
      traces.push({ name: `baseline (run ${data.baseline_run_id})`, x: steps(data.baseline.ref64_max_abs),
                    y: data.baseline.ref64_max_abs, customdata: numbers(data.baseline.ref64_max_abs),
                    hovertemplate: HOVER, mode: "lines", line: { color: "#0969da", width: 2, dash: "dash" } });
    }
    const shapes = data.first_divergent_step ? [{ type: "line", xref: "x", yref: "paper", x0: data.first_divergent_step,
      x1: data.first_divergent_step, y0: 0, y1: 1, line: { color: "#57606a", dash: "dot", width: 1 } }] : [];
    await Plotly.react(target, traces, { ...layout("max |p − float64 reference| per step", "max abs distance"), shapes }, config);
    const diffTarget = document.getElementById("diff-plot");
    const note = document.getElementById("diff-note");
    if (data.max_abs_diff_per_step) {
      note.hidden = true; diffTarget.hidden = false;
      await Plotly.react(diffTarget, [{ name: "|commit − baseline|", x: steps(data.max_abs_diff_per_step),
        y: data.max_abs_diff_per_step, customdata: numbers(data.max_abs_diff_per_step), hovertemplate: HOVER,
        mode: "lines", line: { color: "#8250df", width: 2 } }],
        layout("max |commit − baseline| per step", "max abs difference"), config);
    } else {
      Plotly.purge(diffTarget); diffTarget.hidden = true; note.hidden = false;
    }
    target.dataset.plotted = caseId;
  }

  // Commit / verify page, above the fold: one small panel per optimizer · family, each changed case
  // drawn in its own scale (service/dashboard/commit_page.py computed the values); no legend in a
  // panel this small, the hover names the case and its value as the table writes it.
  const PANEL_COLOURS = ["#cf222e", "#0969da", "#8250df", "#1a7f37", "#bc4c00", "#57606a"];
  async function smallMultiples(panels) {
    await Promise.all(panels.map((panel, index) => {
      const target = document.getElementById(`panel-${index + 1}`);
      const traces = panel.lines.map((line, i) => ({
        name: line.label, x: line.steps, y: line.values, customdata: numbers(line.values),
        hovertemplate: `${line.label}<br>step %{x}: %{customdata}<extra></extra>`,
        mode: line.values.length > 2 ? "lines" : "lines+markers",  // a one-step case is a point
        connectgaps: false, line: { color: PANEL_COLOURS[i % PANEL_COLOURS.length], width: 1.5 },
      }));
      const figure = {
        margin: { l: 52, r: 8, t: 6, b: 30 }, showlegend: false, autosize: true, height: 170,
        xaxis: { title: { text: "step", standoff: 2 }, automargin: true },
        yaxis: { type: "log", exponentformat: "e", automargin: true },
      };
      return Plotly.react(target, traces, figure, { ...config, displayModeBar: false })
        .then(() => { target.dataset.plotted = String(traces.length); });
    }));
    document.getElementById("divergence-panels").dataset.plotted = "true";
  }

  // Training impact (service/dashboard/training_panel.py computed the bands): one panel per model x
  // configuration, the commit's and the baseline's mean loss over the seeds, the seed spread and the
  // one-ulp floor shaded around the baseline's mean, the first step the parameters differ dotted.
  // "difference" (the page's default) draws the same with the baseline's mean taken away from each
  // (the bands about zero): a change far smaller than the loss's fall is visible there. The page's key names each
  // trace once (a legend in every small panel would crowd it); the hover names the line. The
  // payload holds numbers only: no stored string reaches plotly.
  const TRAINING_COLOURS = { commit: "#cf222e", baseline: "#0969da", spread: "rgba(9, 105, 218, 0.22)",
                             floor: "rgba(188, 76, 0, 0.45)", firstStep: "#57606a" };
  const minus = (values, base) => values.map((v, i) => (v === null || base[i] === null ? null : v - base[i]));

  function trainingTraces(p, difference) {
    const zero = p.baseline_mean.map((v) => (v === null ? null : 0));
    const y = (values) => (difference ? minus(values, p.baseline_mean) : values);
    // A band is two traces: its lower edge (no line), then its upper edge filled down to it.
    const band = (low, high, name, colour) => [
      { name: `${name}: lower edge`, x: p.steps, y: y(low), mode: "lines", line: { width: 0 }, hoverinfo: "skip",
        connectgaps: false },
      { name, x: p.steps, y: y(high), mode: "lines", line: { width: 0 }, fill: "tonexty", fillcolor: colour,
        hoverinfo: "skip", connectgaps: false },
    ];
    const mean = (values, name, colour, dash) => ({
      name, x: p.steps, y: values, mode: "lines", connectgaps: false, customdata: numbers(values),
      hovertemplate: `${name}<br>step %{x}: %{customdata}<extra></extra>`, line: { color: colour, width: 1.5, dash },
    });
    return [
      ...band(p.spread_low, p.spread_high, "seed spread: baseline ± 1 sample std", TRAINING_COLOURS.spread),
      ...band(p.floor_low, p.floor_high, "one-ulp floor: baseline ± RMS(floor − baseline)", TRAINING_COLOURS.floor),
      mean(difference ? zero : p.baseline_mean, `baseline: mean of ${p.seeds} seeds`, TRAINING_COLOURS.baseline, "dash"),
      mean(difference ? minus(p.commit_mean, p.baseline_mean) : p.commit_mean,
           difference ? "this commit − baseline (means)" : `this commit: mean of ${p.seeds} seeds`,
           TRAINING_COLOURS.commit, "solid"),
    ];
  }

  async function drawTraining(panels, difference) {
    await Promise.all(panels.filter((p) => p.steps).map((p) => {
      const target = document.getElementById(`training-plot-${p.panel}`);
      const traces = trainingTraces(p, difference);
      const step = p.first_divergent_step;
      const shapes = step ? [{ type: "line", xref: "x", yref: "paper", x0: step, x1: step, y0: 0, y1: 1,
                               line: { color: TRAINING_COLOURS.firstStep, dash: "dot", width: 1 } }] : [];
      const figure = {
        margin: { l: 52, r: 8, t: 6, b: 30 }, showlegend: false, autosize: true, height: 200, shapes,
        // From step 0, so a line at the first step stands clear of the axis.
        xaxis: { title: { text: "step", standoff: 2 }, automargin: true, range: [0, p.steps.length + 1] },
        yaxis: { title: { text: difference ? "Δ loss vs baseline" : "loss", standoff: 2 }, automargin: true,
                 exponentformat: "e" },
      };
      return Plotly.react(target, traces, figure, { ...config, displayModeBar: false })
        .then(() => { target.dataset.plotted = String(traces.length); });
    }));
    const holder = document.getElementById("training-panels");
    holder.dataset.view = difference ? "difference" : "loss";
    holder.dataset.plotted = "true";
  }

  function trainingPanels(panels) {
    const chosen = () => document.querySelector("input[name=training-y]:checked")?.value === "difference";
    for (const input of document.querySelectorAll("input[name=training-y]")) {
      input.addEventListener("change", () => drawTraining(panels, chosen()));
    }
    return drawTraining(panels, chosen());
  }

  // A queued or running training impact: its progress from the API; when it is over, reload.
  function pollTraining(runId) {
    const tick = async () => {
      try {
        const job = await getJSON(`/api/v1/runs/${runId}/training?curves=false`);
        const p = job.progress;
        const bar = document.getElementById("training-progress-bar");
        if (bar) { bar.max = p.runs_total || 1; bar.value = p.runs_done; }
        const text = document.getElementById("training-progress-text");
        if (text) {
          text.textContent = `${job.status}: ${p.runs_done}/${p.runs_total} training runs done`
            + (p.phase ? ` · phase: ${p.phase}` : "") + (job.status === "queued" ? " · waiting for a worker" : "");
        }
        if (job.status !== "queued" && job.status !== "running") { window.location.reload(); return; }
      } catch (error) { console.warn(error.message); }
      setTimeout(tick, POLL_MS);
    };
    setTimeout(tick, POLL_MS);
  }

  // Release drift: one line per case of the chosen family across releases.
  function releasesPage() {
    const source = document.getElementById("release-lines");
    if (!source) return;
    const payload = JSON.parse(source.textContent);
    const select = document.getElementById("group-select");
    const draw = () => {
      const group = select.value;
      document.getElementById("chosen-group").textContent = group;
      const cases = payload.lines[group] || {};
      // A case is named by what it is; its id (with the hash) only in the hover.
      const traces = (Array.isArray(cases) ? cases : []).map((line) => ({
        name: line.name, x: payload.releases, y: line.values, mode: "lines+markers",
        customdata: numbers(line.values), hovertemplate: `${line.name}<br>${line.case_id}<br>%{x}: %{customdata}<extra></extra>`,
        connectgaps: false,
      }));
      const figure = layout("final distance to the float64 reference", "max abs distance");
      figure.xaxis = { title: { text: "release" }, type: "category" };
      // The legend names each case, even a lone one; the axis spans at least a decade, so a change
      // of a few roundings draws flat and a x1700 one climbs (as the row's sparkline does).
      figure.showlegend = true;
      const finite = traces.flatMap((t) => t.y).filter((v) => v !== null && v > 0);
      if (finite.length) {
        const low = Math.log10(Math.min(...finite)), high = Math.log10(Math.max(...finite));
        const middle = (low + high) / 2, half = Math.max(0.5, (high - low) / 2 + 0.1);
        figure.yaxis.range = [middle - half, middle + half];
      }
      Plotly.react("line-plot", traces, figure, config);
      document.getElementById("line-plot").dataset.plotted = group;
    };
    select.addEventListener("change", draw);
    draw();
  }

  function choosePair(select) {
    const [environment, battery] = select.value.split("|");
    window.location.search = new URLSearchParams({ environment, battery }).toString();
  }

  return { pollOverview, runPage, releasesPage, choosePair, number, numbers };
})();
