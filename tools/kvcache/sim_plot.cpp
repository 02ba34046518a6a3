// kvcache sim: the hit-rate plot.
#include "sim_plot.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include <fmt/format.h>

#include "svg.h"

namespace kvc::cli {

std::string plot_hit_rates(const std::vector<sim_result>& results, const trace_stats& ts,
                           const std::string& title) {
    const double W = 720, H = 440, L = 70, R = 190, T = 40, B = 60;  // plot area inside the margins
    const double pw = W - L - R, ph = H - T - B;
    const double unique = static_cast<double>(std::max<uint64_t>(ts.unique_tokens, 1));
    std::vector<double> xs;
    xs.reserve(results.size());
    for (const sim_result& r : results) xs.push_back(100.0 * static_cast<double>(r.budget_tokens) / unique);
    const double x0 = xs.empty() ? 1 : *std::min_element(xs.begin(), xs.end());
    const double x1 = xs.empty() ? 1 : *std::max_element(xs.begin(), xs.end());
    const bool logx = x1 > 3 * x0;
    const auto fx = [&](double x) {
        if (x1 <= x0) return L + pw / 2;
        return logx ? L + pw * (std::log(x) - std::log(x0)) / (std::log(x1) - std::log(x0))
                    : L + pw * (x - x0) / (x1 - x0);
    };
    const auto fy = [&](double y) { return T + ph * (1 - y); };
    std::string body;
    body += svg_text(W / 2, 22, 14, fmt::format("token hit rate against cache budget: {}", title),
                     "text-anchor='middle'");
    // axes, grid and labels
    for (int i = 0; i <= 5; ++i) {
        const double y = fy(i / 5.0);
        body += fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='#dddddd'/>\n", L, y, L + pw, y);
        body += svg_text(L - 8, y + 4, 11, fmt::format("{}%", i * 20), "text-anchor='end'");
    }
    std::vector<double> ticks = xs;
    std::sort(ticks.begin(), ticks.end());
    ticks.erase(std::unique(ticks.begin(), ticks.end()), ticks.end());
    for (double x : ticks) {
        body += fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='#dddddd'/>\n", fx(x), T, fx(x),
                            T + ph);
        body += svg_text(fx(x), T + ph + 16, 11, fmt::format("{:.3g}%", x), "text-anchor='middle'");
    }
    body += fmt::format("<rect x='{}' y='{}' width='{}' height='{}' fill='none' stroke='#333333'/>\n", L, T,
                        pw, ph);
    body += svg_text(L + pw / 2, H - 18, 12,
                     fmt::format("budget, % of the {} unique prompt tokens{}", ts.unique_tokens,
                                 logx ? " (log scale)" : ""),
                     "text-anchor='middle'");
    body += svg_text(18, T + ph / 2, 12, "token hit rate",
                     fmt::format("text-anchor='middle' transform='rotate(-90 18 {})'", T + ph / 2));
    // the infinite cache
    const double ideal = ts.prompt_tokens
                             ? static_cast<double>(ts.reusable_tokens) / static_cast<double>(ts.prompt_tokens)
                             : 0;
    body += fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='#888888' stroke-dasharray='6,4'/>\n",
                        L, fy(ideal), L + pw, fy(ideal));
    // one line per policy, in the order they first appear
    static const char* colours[] = {"#4e79a7", "#f28e2b", "#e15759", "#59a14f", "#b07aa1", "#9c755f"};
    std::vector<std::string> order;  // labels: kvcache once per admission order
    std::map<std::string, std::vector<std::pair<double, double>>> lines;
    for (size_t i = 0; i < results.size(); ++i) {
        const std::string name = label(results[i]);
        if (!lines.count(name)) order.push_back(name);
        lines[name].emplace_back(xs[i], results[i].hit_rate());
    }
    double ly = T + 10;
    for (size_t k = 0; k < order.size(); ++k) {
        auto pts = lines[order[k]];
        std::sort(pts.begin(), pts.end());
        const char* c = colours[k % 6];
        std::string path;
        for (const auto& [x, y] : pts) path += fmt::format("{},{} ", fx(x), fy(y));
        body += fmt::format("<polyline points='{}' fill='none' stroke='{}' stroke-width='2'/>\n", path, c);
        for (const auto& [x, y] : pts)
            body += fmt::format("<circle cx='{}' cy='{}' r='3.5' fill='{}'/>\n", fx(x), fy(y), c);
        body += fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='{}' stroke-width='2'/>\n",
                            L + pw + 14, ly, L + pw + 40, ly, c);
        body += svg_text(L + pw + 46, ly + 4, 12, order[k]);
        ly += 20;
    }
    body += fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='#888888' stroke-dasharray='6,4'/>\n",
                        L + pw + 14, ly, L + pw + 40, ly);
    body += svg_text(L + pw + 46, ly + 4, 12, fmt::format("infinite cache ({:.1f}%)", 100 * ideal));
    return svg_document(W, H, body);
}

}  // namespace kvc::cli
