// kvcache sim: an SVG of hit rate against budget, one line per policy.
#pragma once

#include <string>
#include <vector>

#include "sim_engine.h"
#include "sim_trace.h"

namespace kvc::cli {

/// Token hit rate (y, 0-100%) against budget (x, % of the unique prompt tokens, log scale when the budgets
/// span more than 3x), a line and markers per policy, the infinite cache as a dashed line, a legend.
std::string plot_hit_rates(const std::vector<sim_result>& results, const trace_stats& ts,
                           const std::string& title);

}  // namespace kvc::cli
