// Small SVG writers shared by the CLI's pictures.
#include "svg.h"

#include <fmt/format.h>

namespace kvc::cli {

std::string svg_rect(double x, double y, double w, double h, const std::string& fill,
                     const std::string& extra) {
    return fmt::format("<rect x='{}' y='{}' width='{}' height='{}' fill='{}' {}/>\n", x, y, w, h, fill,
                       extra);
}

std::string svg_text(double x, double y, int size, const std::string& text, const std::string& extra) {
    std::string esc;
    for (char c : text) {
        if (c == '<')
            esc += "&lt;";
        else if (c == '>')
            esc += "&gt;";
        else if (c == '&')
            esc += "&amp;";
        else
            esc += c;
    }
    return fmt::format("<text x='{}' y='{}' font-size='{}' font-family='sans-serif' {}>{}</text>\n", x, y,
                       size, extra, esc);
}

std::string svg_document(double w, double h, const std::string& body) {
    return fmt::format(
        "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}'>\n<rect width='100%' "
        "height='100%' fill='white'/>\n{}</svg>\n",
        w, h, body);
}

}  // namespace kvc::cli
