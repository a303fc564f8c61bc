use super::*;

fn count(haystack: &str, needle: &str) -> usize {
    haystack.matches(needle).count()
}

fn series(label: &str, points: Vec<(f64, f64)>, dashed: bool) -> Series {
    Series {
        label: label.into(),
        points,
        dashed,
    }
}

fn chart(series: Vec<Series>) -> Chart {
    Chart {
        title: "Memory <&> \"usage\"".into(),
        x_label: "event".into(),
        y_label: "bytes".into(),
        series,
    }
}

fn assert_sane(svg: &str) {
    assert!(svg.starts_with("<svg "), "{}", &svg[..40.min(svg.len())]);
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(!svg.contains("NaN"), "NaN in output");
    assert!(!svg.contains("inf"), "infinity in output");
    assert_eq!(count(svg, "<g "), count(svg, "</g>"));
}

#[test]
fn one_polyline_per_series() {
    let gib = (1u64 << 30) as f64;
    let c = chart(vec![
        series(
            "reserved",
            (0..100)
                .map(|i| (i as f64, i as f64 * gib / 10.0))
                .collect(),
            false,
        ),
        series(
            "allocated",
            (0..100)
                .map(|i| (i as f64, i as f64 * gib / 20.0))
                .collect(),
            true,
        ),
        series("empty", vec![], false),
    ]);
    let svg = render_svg(&c);
    assert_sane(&svg);
    assert_eq!(count(&svg, "<polyline"), 3);
    assert_eq!(count(&svg, "<path"), 0);
    assert!(svg.contains("stroke-dasharray"));
    assert!(svg.contains("GiB"));
    assert!(svg.contains("Memory &lt;&amp;&gt; &quot;usage&quot;"));
    assert!(!svg.contains("<&>"));
}

#[test]
fn empty_and_degenerate_charts_have_no_nan() {
    for c in [
        chart(vec![]),
        chart(vec![series("e", vec![], false)]),
        chart(vec![series("one", vec![(3.0, 5.0)], false)]),
        chart(vec![series("flat", vec![(0.0, 0.0), (10.0, 0.0)], false)]),
        chart(vec![series(
            "vertical",
            vec![(2.0, 0.0), (2.0, 100.0)],
            false,
        )]),
        chart(vec![series("const", vec![(0.0, 7e9), (1.0, 7e9)], false)]),
        chart(vec![series(
            "bad",
            vec![(f64::NAN, 1.0), (1.0, f64::INFINITY), (2.0, 4.0)],
            false,
        )]),
        chart(vec![series("neg", vec![(-5.0, -3.0), (5.0, -1.0)], false)]),
    ] {
        let svg = render_svg(&c);
        assert_sane(&svg);
        assert_eq!(count(&svg, "<polyline"), c.series.len());
    }
}

#[test]
fn y_ticks_are_nice_and_cover_the_peak() {
    let axis = ByteAxis::new(0.0, 14.24 * (1u64 << 30) as f64);
    let ticks = axis.ticks();
    assert!((3..=8).contains(&ticks.len()), "{}", ticks.len());
    assert_eq!(ticks[0].1, "0");
    assert!(ticks.last().unwrap().0 >= 14.24 * (1u64 << 30) as f64);
    assert!(
        ticks.iter().skip(1).all(|(_, l)| l.ends_with(" GiB")),
        "{ticks:?}"
    );
    let small = ByteAxis::new(0.0, 3.0).ticks();
    assert!(
        small.iter().all(|(_, l)| l == "0" || l.ends_with(" B")),
        "{small:?}"
    );
    let mib = ByteAxis::new(0.0, 700.0 * (1u64 << 20) as f64).ticks();
    assert_eq!(mib[1].1, "200 MiB", "{mib:?}");
}

#[test]
fn x_ticks_lie_in_range() {
    let t = x_ticks(0.0, 547_378.0);
    assert!((4..=8).contains(&t.len()), "{t:?}");
    assert!(t.iter().all(|&v| (0.0..=547_378.0).contains(&v)));
    assert_eq!(compact_number(100_000.0), "100k");
    assert_eq!(compact_number(1_500_000.0), "1.5M");
    assert_eq!(compact_number(12.0), "12");
}

#[test]
fn downsampling_keeps_extremes_and_ends() {
    let n = 100_000;
    let mut pts: Vec<(f64, f64)> = (0..n).map(|i| (i as f64, (i % 97) as f64)).collect();
    pts[54_321].1 = 1e12;
    pts[777].1 = -5.0;
    let d = downsample(&pts, MAX_POINTS);
    assert!(d.len() <= MAX_POINTS, "{}", d.len());
    assert!(d.len() > MAX_POINTS / 2);
    assert!(d.contains(&(54_321.0, 1e12)));
    assert!(d.contains(&(777.0, -5.0)));
    assert_eq!(d.first(), pts.first());
    assert_eq!(d.last(), pts.last());
    assert!(d.windows(2).all(|w| w[0].0 < w[1].0), "order kept");
    // Short inputs are untouched; tiny limits still work.
    assert_eq!(downsample(&pts[..10], 4000), pts[..10].to_vec());
    assert!(downsample(&pts, 0).len() <= 4);
}

#[test]
fn long_series_are_downsampled_in_the_svg() {
    let pts: Vec<(f64, f64)> = (0..50_000)
        .map(|i| (i as f64, (i * 3 % 1000) as f64))
        .collect();
    let svg = render_svg(&chart(vec![series("s", pts, false)]));
    assert_sane(&svg);
    let points = svg
        .split("points=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap();
    assert!(points.split(' ').count() <= MAX_POINTS);
}

#[test]
fn panels_form_a_grid() {
    let charts: Vec<Chart> = (0..5)
        .map(|i| {
            chart(vec![series(
                &format!("s{i}"),
                vec![(0.0, 1.0), (1.0, 2.0)],
                false,
            )])
        })
        .collect();
    let svg = render_panels(&charts, 2);
    assert_sane(&svg);
    assert_eq!(count(&svg, "<polyline"), 5);
    assert!(svg.contains(&format!(
        r#"width="{}" height="{}""#,
        2.0 * PANEL_W,
        3.0 * PANEL_H
    )));
    assert!(!svg.contains(&format!("translate({},{})", PANEL_W, 2.0 * PANEL_H)));
    assert!(svg.contains(&format!("translate(0,{})", 2.0 * PANEL_H)));
    // Zero columns means one; no charts still gives a valid document.
    assert_sane(&render_panels(&charts, 0));
    assert_sane(&render_panels(&[], 3));
}

#[test]
fn colours_are_distinct_per_series() {
    let c = chart(
        (0..3)
            .map(|i| series(&format!("s{i}"), vec![(0.0, 0.0), (1.0, i as f64)], false))
            .collect(),
    );
    let svg = render_svg(&c);
    for colour in &PALETTE[..3] {
        assert!(svg.contains(&format!("<polyline fill=\"none\" stroke=\"{colour}\"")));
    }
}

#[test]
fn human_bytes_formats() {
    assert_eq!(human_bytes(0), "0 B");
    assert_eq!(human_bytes(1023), "1023 B");
    assert_eq!(human_bytes(1024), "1 KiB");
    assert_eq!(human_bytes(1536), "1.5 KiB");
    assert_eq!(human_bytes(20 << 20), "20 MiB");
    assert_eq!(
        human_bytes((14.24 * (1u64 << 30) as f64) as u64),
        "14.24 GiB"
    );
    assert_eq!(human_bytes(u64::MAX), "16 EiB");
}

#[test]
fn escape_handles_all_specials() {
    assert_eq!(escape(r#"a<b>&"c'"#), "a&lt;b&gt;&amp;&quot;c&apos;");
}
