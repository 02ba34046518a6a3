// The cost model of one tier (kv_cache's tiers, docs/tiers.md): the time of a read_many call as a
// latency plus a cost per byte returned, fitted by least squares over the calls made, older calls
// weighing less, so that a store that slows down (or recovers) is followed within tens of calls.
#pragma once

#include <algorithm>
#include <utility>

namespace kvc::detail {

class tier_cost {
public:
    // One call that returned `bytes` in `ns`.
    void add(double bytes, double ns) {
        w_ = decay * w_ + 1;
        sx_ = decay * sx_ + bytes;
        sy_ = decay * sy_ + ns;
        sxx_ = decay * sxx_ + bytes * bytes;
        sxy_ = decay * sxy_ + bytes * ns;
        min_ns_ = w_ == 1 ? ns : std::min(min_ns_, ns);
    }
    bool known() const { return w_ > 0; }
    double latency_ns() const { return fit().first; }
    double ns_per_byte() const { return fit().second; }
    double predict(double bytes) const {
        const auto [a, b] = fit();
        return a + b * bytes;
    }

private:
    static constexpr double decay = 0.9;  // a call's weight halves after ~7 later calls

    // (latency, ns per byte). Calls of one size cannot separate the two: the latency is then the fastest
    // call seen, and the rest of the mean is per byte.
    std::pair<double, double> fit() const {
        if (w_ == 0) return {0, 0};
        const double mx = sx_ / w_, my = sy_ / w_;
        const double var = sxx_ / w_ - mx * mx, cov = sxy_ / w_ - mx * my;
        if (var > 1e-6 * mx * mx && var > 1) {
            const double b = std::max(0.0, cov / var);
            return {std::max(0.0, my - b * mx), b};
        }
        if (mx <= 0) return {my, 0};
        const double a = std::min(min_ns_, my);
        return {a, (my - a) / mx};
    }

    double w_ = 0, sx_ = 0, sy_ = 0, sxx_ = 0, sxy_ = 0, min_ns_ = 0;
};

}  // namespace kvc::detail
