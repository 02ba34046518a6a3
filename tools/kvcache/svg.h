// Small SVG writers shared by the CLI's pictures (demo's cell maps, sim's plots).
#pragma once

#include <string>

namespace kvc::cli {

/// A rectangle; `extra` holds more attributes (e.g. "stroke='white'").
std::string svg_rect(double x, double y, double w, double h, const std::string& fill,
                     const std::string& extra = "");
/// Text at (x, y) (baseline), escaped; `extra` holds more attributes (e.g. "text-anchor='middle'").
std::string svg_text(double x, double y, int size, const std::string& text, const std::string& extra = "");
/// A whole document on a white background.
std::string svg_document(double w, double h, const std::string& body);

}  // namespace kvc::cli
