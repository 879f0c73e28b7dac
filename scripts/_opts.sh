# Sourced by the scripts that take options: one parser, each option declared once.
#
#   source "$ROOT/scripts/_opts.sh"
#   opts_parse "--out=OUT --quick=QUICK:1 --policy-arg=PITEMS+" -- "$@"
#
# SPEC is a whitespace-separated list of --OPTION=TARGET, TARGET one of:
#   VAR            value option: VAR=the next argument
#   VAR+           value option: the next argument appended to the array VAR
#   VAR(W,...)     value option: the array VAR=(W ... the next argument)
#   VAR:VALUE      flag: VAR=VALUE
#   VAR:(W,...)    flag: the array VAR=(W ...)
# The words W (none or several, comma-separated) are the spec's own, never the user's.
# -h and --help print the calling script's header comment (its leading # lines after the
# shebang, "# " stripped) and exit 0. Anything else not in SPEC, and a value option with nothing
# after it (or another --option), print "NAME: ..." on stderr and exit 2, NAME the calling
# script's file name without .sh. Variables are set with printf -v and namerefs, so a value is
# only ever data; they resolve as plain assignments do (the caller's locals, else globals), which
# is why every name in here begins with _opts_ and SPEC may not use that prefix.

_opts_die() {  # _opts_die NAME MESSAGE: the one-line refusal every script gives
  echo "$1: $2" >&2
  exit 2
}

_opts_help() {  # _opts_help FILE: FILE's header comment
  awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$1"
}

_opts_array() {  # _opts_array VAR WORDS...: VAR=(WORDS...)
  local -n _opts_ref="$1"
  _opts_ref=("${@:2}")
}

_opts_append() {  # _opts_append VAR WORD: VAR+=(WORD)
  local -n _opts_ref="$1"
  _opts_ref+=("$2")
}

opts_parse() {  # opts_parse SPEC -- ARGS...
  local _opts_script="${BASH_SOURCE[1]-$0}" _opts_item _opts_var _opts_kind _opts_i
  local _opts_name _opts_found
  local -a _opts_items=() _opts_opts=() _opts_vars=() _opts_kinds=() _opts_words=()
  _opts_name="$(basename "$_opts_script" .sh)"
  [ "${2-}" = -- ] || _opts_die opts_parse "usage: opts_parse SPEC -- \"\$@\""
  read -r -d '' -a _opts_items <<< "$1" || true  # (read ends at the input's end, not at a NUL)
  for _opts_item in "${_opts_items[@]}"; do
    [[ "$_opts_item" =~ ^(--?[A-Za-z0-9][-A-Za-z0-9]*)=([A-Za-z_][A-Za-z0-9_]*)(\+|\([^()]*\)|:.*)?$ ]] \
      && [[ "${BASH_REMATCH[2]}" != _opts_* ]] \
      || _opts_die opts_parse "$_opts_name: bad spec item '$_opts_item'"
    _opts_opts+=("${BASH_REMATCH[1]}") _opts_vars+=("${BASH_REMATCH[2]}") _opts_kinds+=("${BASH_REMATCH[3]}")
  done
  shift 2
  while [ $# -gt 0 ]; do
    case "$1" in -h|--help) _opts_help "$_opts_script"; exit 0 ;; esac
    _opts_found=""
    for _opts_i in "${!_opts_opts[@]}"; do
      [ "${_opts_opts[$_opts_i]}" = "$1" ] && { _opts_found=1; break; }
    done
    [ -n "$_opts_found" ] || _opts_die "$_opts_name" "unknown option $1"
    _opts_var="${_opts_vars[$_opts_i]}" _opts_kind="${_opts_kinds[$_opts_i]}"
    case "$_opts_kind" in
      :\(*\))
        IFS=, read -r -a _opts_words <<< "${_opts_kind:2:-1}"
        _opts_array "$_opts_var" ${_opts_words[@]+"${_opts_words[@]}"}
        shift; continue ;;
      :*) printf -v "$_opts_var" '%s' "${_opts_kind#:}"; shift; continue ;;
    esac
    # a value that looks like an option is a forgotten value: `--out --quick` is not OUT=--quick
    [ $# -ge 2 ] && [ "${2#--}" = "$2" ] || _opts_die "$_opts_name" "$1 needs a value"
    case "$_opts_kind" in
      "") printf -v "$_opts_var" '%s' "$2" ;;
      +) _opts_append "$_opts_var" "$2" ;;
      *)
        IFS=, read -r -a _opts_words <<< "${_opts_kind:1:-1}"
        _opts_array "$_opts_var" ${_opts_words[@]+"${_opts_words[@]}"} "$2" ;;
    esac
    shift 2
  done
}
