//! RFC 6570 URI templates read backwards: whether a URI is one of the expansions a
//! template can produce, for some values of its variables (levels 1 to 4: every
//! operator, lists of variables, `*` and `:N`).
//!
//! An expansion encodes what it inserts, so the characters a value may show depend on
//! the operator: `{var}`, `{.x}`, `{/x}`, `{;x}`, `{?x}`, `{&x}` show unreserved
//! characters (`A-Z a-z 0-9 - . _ ~`) and `%HH` triplets only, so a `/`, `?`, `=` or
//! `,` in the URI is the template's, never a value's; `{+x}` and `{#x}` also let the
//! reserved characters (`:/?#[]@!$&'()*+,;=`) through. Any variable may be undefined
//! (`{?x,y}` matches `?x=1`, `?y=2`, both in that order, or nothing), a defined one may
//! be empty, a list or an associative array (`{x*}` matches `a.b` for `{.x*}`,
//! `k=v,k2=v2` for `{x*}`). `:N` allows at most N characters, a `%HH` triplet of a
//! UTF-8 character counting once. Literal text matches itself, or its encoded form.
//!
//! A template that is not valid RFC 6570 (an unclosed or stray brace, an empty
//! expression, a reserved operator `= , ! @ |`, a bad variable name or `:N` outside
//! 1..=9999) matches nothing.
//!
//! The match runs over the positions of the URI reachable after each piece, each step
//! one pass over the URI with a few states, so a long URI or many expressions stay
//! linear in the URI's length per piece.

/// Which characters a value may show unencoded (besides `%HH` triplets).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Allowed {
    /// RFC 3986 unreserved characters.
    Unreserved,
    /// Unreserved and reserved characters (`+` and `#`).
    UnreservedReserved,
}

/// One expression's operator (RFC 6570 appendix A's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Operator {
    /// Written before the first defined variable.
    first: Option<u8>,
    /// Written between defined variables, and between the items of an exploded one.
    separator: u8,
    /// Variables are written `name=value`.
    named: bool,
    /// For a named operator: an empty value is written `name=` (`?`, `&`) rather than
    /// `name` (`;`).
    empty_with_equals: bool,
    allowed: Allowed,
}

impl Operator {
    fn of(byte: Option<u8>) -> Option<Operator> {
        let plain = Operator {
            first: None,
            separator: b',',
            named: false,
            empty_with_equals: false,
            allowed: Allowed::Unreserved,
        };
        Some(match byte {
            None => plain,
            Some(b'+') => Operator {
                allowed: Allowed::UnreservedReserved,
                ..plain
            },
            Some(b'#') => Operator {
                first: Some(b'#'),
                allowed: Allowed::UnreservedReserved,
                ..plain
            },
            Some(b'.') => Operator {
                first: Some(b'.'),
                separator: b'.',
                ..plain
            },
            Some(b'/') => Operator {
                first: Some(b'/'),
                separator: b'/',
                ..plain
            },
            Some(b';') => Operator {
                first: Some(b';'),
                separator: b';',
                named: true,
                ..plain
            },
            Some(b'?') => Operator {
                first: Some(b'?'),
                separator: b'&',
                named: true,
                empty_with_equals: true,
                ..plain
            },
            Some(b'&') => Operator {
                first: Some(b'&'),
                separator: b'&',
                named: true,
                empty_with_equals: true,
                ..plain
            },
            Some(_) => return None,
        })
    }
}

/// How a variable is expanded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Modifier {
    None,
    /// `:N`: at most N characters of a string value.
    Prefix(usize),
    /// `*`: a list's or an associative array's items each on their own.
    Explode,
}

#[derive(Debug, PartialEq, Eq)]
struct VarSpec<'a> {
    name: &'a [u8],
    modifier: Modifier,
}

#[derive(Debug, PartialEq, Eq)]
enum Piece<'a> {
    /// Literal text as written, and its encoded form where that differs.
    Literal(&'a [u8], Option<Vec<u8>>),
    Expression(Operator, Vec<VarSpec<'a>>),
}

/// A template's pieces, or None when it is not a valid RFC 6570 template.
fn parse(template: &str) -> Option<Vec<Piece<'_>>> {
    let mut pieces = Vec::new();
    let mut rest = template.as_bytes();
    while let Some(&byte) = rest.first() {
        match byte {
            b'{' => {
                let close = rest.iter().position(|b| *b == b'}')?;
                let inside = &rest[1..close];
                if inside.contains(&b'{') {
                    return None;
                }
                pieces.push(expression(inside)?);
                rest = &rest[close + 1..];
            }
            b'}' => return None,
            _ => {
                let end = rest
                    .iter()
                    .position(|b| matches!(b, b'{' | b'}'))
                    .unwrap_or(rest.len());
                let literal = &rest[..end];
                let encoded = encode_literal(literal);
                pieces.push(Piece::Literal(literal, encoded));
                rest = &rest[end..];
            }
        }
    }
    Some(pieces)
}

/// One expression's operator and variables (the text between its braces).
fn expression(inside: &[u8]) -> Option<Piece<'_>> {
    let (operator, list) = match inside.first() {
        Some(b'+' | b'#' | b'.' | b'/' | b';' | b'?' | b'&') => {
            (Operator::of(Some(inside[0]))?, &inside[1..])
        }
        Some(b'=' | b',' | b'!' | b'@' | b'|') | None => return None,
        Some(_) => (Operator::of(None)?, inside),
    };
    let vars = list
        .split(|b| *b == b',')
        .map(var_spec)
        .collect::<Option<Vec<_>>>()?;
    Some(Piece::Expression(operator, vars))
}

fn var_spec(spec: &[u8]) -> Option<VarSpec<'_>> {
    let (name, modifier) = if let Some(name) = spec.strip_suffix(b"*") {
        (name, Modifier::Explode)
    } else if let Some(colon) = spec.iter().position(|b| *b == b':') {
        let digits = &spec[colon + 1..];
        let valid = (1..=4).contains(&digits.len())
            && digits.iter().all(u8::is_ascii_digit)
            && digits[0] != b'0';
        if !valid {
            return None;
        }
        let max = std::str::from_utf8(digits).ok()?.parse().ok()?;
        (&spec[..colon], Modifier::Prefix(max))
    } else {
        (spec, Modifier::None)
    };
    valid_name(name).then_some(VarSpec { name, modifier })
}

/// `varname = varchar *( ["."] varchar )`, `varchar = ALPHA / DIGIT / "_" / pct-encoded`.
fn valid_name(name: &[u8]) -> bool {
    let mut at = 0;
    let mut after_char = false;
    while at < name.len() {
        match name[at] {
            b'.' if after_char => {
                after_char = false;
                at += 1;
            }
            b'%' if triplet(&name[at..]) => {
                after_char = true;
                at += 3;
            }
            b if b.is_ascii_alphanumeric() || b == b'_' => {
                after_char = true;
                at += 1;
            }
            _ => return false,
        }
    }
    after_char
}

fn unreserved(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~')
}

fn reserved(byte: u8) -> bool {
    b":/?#[]@!$&'()*+,;=".contains(&byte)
}

fn triplet(text: &[u8]) -> bool {
    text.len() >= 3 && text[0] == b'%' && text[1].is_ascii_hexdigit() && text[2].is_ascii_hexdigit()
}

/// A literal as an expansion writes it (characters outside unreserved and reserved
/// percent-encoded), or None when that is the literal itself.
fn encode_literal(literal: &[u8]) -> Option<Vec<u8>> {
    let mut encoded = Vec::with_capacity(literal.len());
    let mut at = 0;
    while at < literal.len() {
        let byte = literal[at];
        if triplet(&literal[at..]) {
            encoded.extend_from_slice(&literal[at..at + 3]);
            at += 3;
            continue;
        }
        if unreserved(byte) || reserved(byte) {
            encoded.push(byte);
        } else {
            encoded.extend_from_slice(format!("%{byte:02X}").as_bytes());
        }
        at += 1;
    }
    (encoded != literal).then_some(encoded)
}

/// One character a value may show at the start of `text`: its length, and how many
/// characters of the value it counts for (a `%HH` continuation byte of UTF-8: none).
fn value_char(text: &[u8], allowed: Allowed) -> Option<(usize, usize)> {
    let byte = *text.first()?;
    if byte == b'%' {
        if !triplet(text) {
            return None;
        }
        let hex = std::str::from_utf8(&text[1..3]).ok()?;
        let value = u8::from_str_radix(hex, 16).ok()?;
        let counts = usize::from(!(0x80..0xC0).contains(&value));
        return Some((3, counts));
    }
    let shown = match allowed {
        Allowed::Unreserved => unreserved(byte),
        Allowed::UnreservedReserved => unreserved(byte) || reserved(byte),
    };
    shown.then_some((1, 1))
}

/// The positions of the URI (0..=len) a match may have reached.
type Reach = Vec<bool>;

fn union(mut a: Reach, b: &Reach) -> Reach {
    a.iter_mut().zip(b).for_each(|(a, b)| *a |= *b);
    a
}

/// The positions right after `text` where it starts at a position of `starts`.
fn literal(uri: &[u8], starts: &Reach, text: &[u8]) -> Reach {
    let mut ends = vec![false; uri.len() + 1];
    for start in (0..=uri.len()).filter(|at| starts[*at]) {
        if uri[start..].starts_with(text) {
            ends[start + text.len()] = true;
        }
    }
    ends
}

/// One step of a small automaton: from a state, over one value character or one byte.
#[derive(Debug, Clone, Copy)]
enum Edge {
    Char,
    Byte(u8),
}

/// A small automaton over a value's text. State 0 is where it starts; every edge
/// consumes at least one byte, so one forward pass over the URI runs it.
struct Automaton {
    edges: Vec<(u8, Edge, u8)>,
    /// Bit per accepting state.
    accepting: u8,
    allowed: Allowed,
}

impl Automaton {
    /// `(char | extra)*`: a value, or several joined by `extra`.
    fn repeat(allowed: Allowed, extra: u8) -> Automaton {
        Automaton {
            edges: vec![(0, Edge::Char, 0), (0, Edge::Byte(extra), 0)],
            accepting: 0b1,
            allowed,
        }
    }

    /// `(char | extra)+`.
    fn repeat_some(allowed: Allowed, extra: u8) -> Automaton {
        Automaton {
            edges: vec![
                (0, Edge::Char, 1),
                (0, Edge::Byte(extra), 1),
                (1, Edge::Char, 1),
                (1, Edge::Byte(extra), 1),
            ],
            accepting: 0b10,
            allowed,
        }
    }

    /// `key=value` pairs joined by `separator` (an exploded associative array); with
    /// `bare_key`, a pair with an empty value is the key alone (`;`), else `key=`.
    fn pairs(allowed: Allowed, separator: u8, bare_key: bool) -> Automaton {
        // 0: in a key; 1: just after '=' (bare keys only); 2: in the value.
        let mut edges = vec![
            (0, Edge::Char, 0),
            (2, Edge::Char, 2),
            (2, Edge::Byte(separator), 0),
        ];
        let accepting = if bare_key {
            edges.extend([
                (0, Edge::Byte(b'='), 1),
                (1, Edge::Char, 2),
                (0, Edge::Byte(separator), 0),
            ]);
            0b101
        } else {
            edges.push((0, Edge::Byte(b'='), 2));
            0b100
        };
        Automaton {
            edges,
            accepting,
            allowed,
        }
    }

    /// The positions where a run that began at a position of `starts` may end.
    fn run(&self, uri: &[u8], starts: &Reach) -> Reach {
        let mut states: Vec<u8> = starts.iter().map(|s| u8::from(*s)).collect();
        for at in 0..=uri.len() {
            let here = states[at];
            if here == 0 {
                continue;
            }
            for &(from, edge, to) in &self.edges {
                if here & (1 << from) == 0 {
                    continue;
                }
                let length = match edge {
                    Edge::Char => value_char(&uri[at..], self.allowed).map(|(length, _)| length),
                    Edge::Byte(byte) => (uri.get(at) == Some(&byte)).then_some(1),
                };
                if let Some(length) = length {
                    states[at + length] |= 1 << to;
                }
            }
        }
        states.iter().map(|s| s & self.accepting != 0).collect()
    }
}

/// A string value of at most `max` characters (`:N`), non-empty when `non_empty`.
fn bounded(uri: &[u8], starts: &Reach, allowed: Allowed, max: usize, non_empty: bool) -> Reach {
    // The fewest characters a value from some start needs to reach each position,
    // over any run (`any`) and over runs of at least one character (`some`).
    let mut any: Vec<Option<usize>> = starts.iter().map(|s| s.then_some(0)).collect();
    let mut some: Vec<Option<usize>> = vec![None; uri.len() + 1];
    for at in 0..uri.len() {
        let Some(count) = any[at] else {
            continue;
        };
        if let Some((length, counts)) = value_char(&uri[at..], allowed) {
            let next = Some(count + counts);
            let fewer = |held: Option<usize>| held.map_or(next, |h| next.min(Some(h)));
            any[at + length] = fewer(any[at + length]);
            some[at + length] = fewer(some[at + length]);
        }
    }
    let counts = if non_empty { some } else { any };
    counts.iter().map(|c| c.is_some_and(|c| c <= max)).collect()
}

/// Where one defined variable's expansion may end, from `starts`.
fn variable(uri: &[u8], starts: &Reach, operator: Operator, var: &VarSpec<'_>) -> Reach {
    let allowed = operator.allowed;
    if !operator.named {
        return match var.modifier {
            Modifier::Prefix(max) => bounded(uri, starts, allowed, max, false),
            Modifier::None => Automaton::repeat(allowed, b',').run(uri, starts),
            Modifier::Explode => union(
                Automaton::repeat(allowed, operator.separator).run(uri, starts),
                &Automaton::pairs(allowed, operator.separator, false).run(uri, starts),
            ),
        };
    }
    if var.modifier == Modifier::Explode {
        // Each item `name=value` (a list) or `key=value` (an associative array): the
        // name is one of the keys a pair may have.
        let bare_key = !operator.empty_with_equals;
        return Automaton::pairs(allowed, operator.separator, bare_key).run(uri, starts);
    }
    let named = literal(uri, starts, var.name);
    let equals = literal(uri, &named, b"=");
    let valued = match (var.modifier, operator.empty_with_equals) {
        (Modifier::Prefix(max), with_equals) => bounded(uri, &equals, allowed, max, !with_equals),
        (_, true) => Automaton::repeat(allowed, b',').run(uri, &equals),
        (_, false) => Automaton::repeat_some(allowed, b',').run(uri, &equals),
    };
    match operator.empty_with_equals {
        // `;` writes an empty value as the name alone.
        false => union(valued, &named),
        true => valued,
    }
}

/// Where an expression's expansion may end, from `starts`: each variable undefined
/// (left out) or expanded, the first defined one after the operator's first character,
/// the others after its separator; with none defined, the expression is empty.
fn expression_ends(uri: &[u8], starts: &Reach, operator: Operator, vars: &[VarSpec<'_>]) -> Reach {
    let after_first = match operator.first {
        Some(first) => literal(uri, starts, &[first]),
        None => starts.clone(),
    };
    let mut some_defined = vec![false; uri.len() + 1];
    for var in vars {
        let after_separator = literal(uri, &some_defined, &[operator.separator]);
        let from = union(after_separator, &after_first);
        some_defined = union(some_defined, &variable(uri, &from, operator, var));
    }
    union(some_defined, starts)
}

/// Whether `uri` is an expansion of `template` (see the module's note).
pub fn template_matches(template: &str, uri: &str) -> bool {
    let Some(pieces) = parse(template) else {
        return false;
    };
    let uri = uri.as_bytes();
    let mut reach = vec![false; uri.len() + 1];
    reach[0] = true;
    for piece in &pieces {
        reach = match piece {
            Piece::Literal(raw, encoded) => {
                let written = literal(uri, &reach, raw);
                match encoded {
                    Some(encoded) => union(written, &literal(uri, &reach, encoded)),
                    None => written,
                }
            }
            Piece::Expression(operator, vars) => expression_ends(uri, &reach, *operator, vars),
        };
        if !reach.contains(&true) {
            return false;
        }
    }
    reach[uri.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 6570 section 3.2's examples (levels 1 to 4), each expansion matched by its
    /// template. Values: var = "value", hello = "Hello World!", path = "/foo/bar",
    /// list = (red, green, blue), keys = [(semi, ";"), (dot, "."), (comma, ",")],
    /// x = 1024, y = 768, empty = "", undef undefined.
    const RFC_EXAMPLES: &[(&str, &str)] = &[
        ("{var}", "value"),
        ("{hello}", "Hello%20World%21"),
        ("{+var}", "value"),
        ("{+hello}", "Hello%20World!"),
        ("{+path}/here", "/foo/bar/here"),
        ("here?ref={+path}", "here?ref=/foo/bar"),
        ("X{#var}", "X#value"),
        ("X{#hello}", "X#Hello%20World!"),
        ("map?{x,y}", "map?1024,768"),
        ("{x,hello,y}", "1024,Hello%20World%21,768"),
        ("{+x,hello,y}", "1024,Hello%20World!,768"),
        ("{+path,x}/here", "/foo/bar,1024/here"),
        ("{#x,hello,y}", "#1024,Hello%20World!,768"),
        ("{#path,x}/here", "#/foo/bar,1024/here"),
        ("X{.var}", "X.value"),
        ("X{.x,y}", "X.1024.768"),
        ("{/var}", "/value"),
        ("{/var,x}/here", "/value/1024/here"),
        ("{;x,y}", ";x=1024;y=768"),
        ("{;x,y,empty}", ";x=1024;y=768;empty"),
        ("{?x,y}", "?x=1024&y=768"),
        ("{?x,y,empty}", "?x=1024&y=768&empty="),
        ("?fixed=yes{&x}", "?fixed=yes&x=1024"),
        ("{&x,y,empty}", "&x=1024&y=768&empty="),
        ("{var:3}", "val"),
        ("{var:30}", "value"),
        ("{list}", "red,green,blue"),
        ("{list*}", "red,green,blue"),
        ("{keys}", "semi,%3B,dot,.,comma,%2C"),
        ("{keys*}", "semi=%3B,dot=.,comma=%2C"),
        ("{+path:6}/here", "/foo/b/here"),
        ("{+list}", "red,green,blue"),
        ("{+list*}", "red,green,blue"),
        ("{+keys}", "semi,;,dot,.,comma,,"),
        ("{+keys*}", "semi=;,dot=.,comma=,"),
        ("{#path:6}/here", "#/foo/b/here"),
        ("{#list}", "#red,green,blue"),
        ("{#keys*}", "#semi=;,dot=.,comma=,"),
        ("X{.var:3}", "X.val"),
        ("X{.list}", "X.red,green,blue"),
        ("X{.list*}", "X.red.green.blue"),
        ("X{.keys}", "X.semi,%3B,dot,.,comma,%2C"),
        ("X{.keys*}", "X.semi=%3B.dot=..comma=%2C"),
        ("{/var:1,var}", "/v/value"),
        ("{/list}", "/red,green,blue"),
        ("{/list*}", "/red/green/blue"),
        ("{/list*,path:4}", "/red/green/blue/%2Ffoo"),
        ("{/keys}", "/semi,%3B,dot,.,comma,%2C"),
        ("{/keys*}", "/semi=%3B/dot=./comma=%2C"),
        ("{;hello:5}", ";hello=Hello"),
        ("{;list}", ";list=red,green,blue"),
        ("{;list*}", ";list=red;list=green;list=blue"),
        ("{;keys}", ";keys=semi,%3B,dot,.,comma,%2C"),
        ("{;keys*}", ";semi=%3B;dot=.;comma=%2C"),
        ("{?var:3}", "?var=val"),
        ("{?list}", "?list=red,green,blue"),
        ("{?list*}", "?list=red&list=green&list=blue"),
        ("{?keys}", "?keys=semi,%3B,dot,.,comma,%2C"),
        ("{?keys*}", "?semi=%3B&dot=.&comma=%2C"),
        ("{&var:3}", "&var=val"),
        ("{&list*}", "&list=red&list=green&list=blue"),
        ("{&keys*}", "&semi=%3B&dot=.&comma=%2C"),
        // Undefined and empty variables.
        ("{undef}", ""),
        ("X{.undef}", "X"),
        ("{?undef}", ""),
        ("{;empty}", ";empty"),
        ("{?x,undef,y}", "?x=1024&y=768"),
        ("O{empty}X", "OX"),
    ];

    #[test]
    fn every_rfc_6570_example_expansion_matches_its_template() {
        for (template, uri) in RFC_EXAMPLES {
            assert!(
                template_matches(template, uri),
                "{template} should match {uri}"
            );
        }
    }

    /// (template, URI, matches): what each operator lets a value contain, optional
    /// and ordered query parameters, prefixes, and templates that are no templates.
    const CASES: &[(&str, &str, bool)] = &[
        // Level 1: a value holds unreserved characters and %HH, never '/', '?', ...
        ("mem://a/notes/{note}", "mem://a/notes/x1", true),
        ("mem://a/notes/{note}", "mem://a/notes/a%20b", true),
        ("mem://a/notes/{note}", "mem://a/notes/", true),
        ("mem://a/notes/{note}", "mem://a/notes/x/y", false),
        ("mem://a/notes/{note}", "mem://a/notes/x?y", false),
        ("mem://a/notes/{note}", "mem://a/notes/x#y", false),
        ("mem://a/notes/{note}", "mem://a/notes/a b", false),
        ("mem://a/notes/{note}", "mem://a/notes/a:b", false),
        ("mem://a/notes/{note}", "mem://a/notes/a=b", false),
        ("mem://a/notes/{note}", "mem://a/notes/50%", false),
        ("mem://a/notes/{note}", "mem://a/notes/%zz", false),
        ("mem://a/notes/{note}", "mem://a/notes/é", false),
        ("mem://a/notes/{note}", "mem://a/notes/%C3%A9", true),
        ("mem://a/notes/{note}", "mem://b/notes/x", false),
        ("mem://a/notes/{note}", "mem://a/notes/a,b", true),
        ("db://{table}/{row}.json", "db://users/7.json", true),
        ("db://{table}/{row}.json", "db://users/7.xml", false),
        ("x://{a}{b}", "x://ab", true),
        ("plain://exact", "plain://exact", true),
        ("plain://exact", "plain://exact2", false),
        ("plain://a b", "plain://a%20b", true),
        ("plain://a b", "plain://a b", true),
        // Level 2: '+' and '#' let reserved characters through.
        ("file://{+path}", "file:///etc/hosts", true),
        ("file://{+path}", "file://a/b?c=d#e", true),
        ("file://{+path}", "file://a b", false),
        ("file://{+path}", "file://50%", false),
        ("file://{path}", "file:///etc/hosts", false),
        ("doc://x{#frag}", "doc://x#sec/1", true),
        ("doc://x{#frag}", "doc://x", true),
        ("doc://x{#frag}", "doc://x/sec", false),
        // Level 3: several variables, each operator's prefix and separator.
        ("map://{x,y}", "map://1,2", true),
        ("map://{x,y}", "map://1", true),
        ("map://{x,y}", "map://1;2", false),
        ("tree://r{/a,b}", "tree://r/x/y", true),
        ("tree://r{/a,b}", "tree://r/x", true),
        ("tree://r{/a,b}", "tree://r/x/y/z", false),
        ("tree://r{/a}", "tree://r/", true),
        ("tree://r{/a}", "tree://rx", false),
        ("name://f{.ext}", "name://f.tar.gz", true),
        ("name://f{.ext}", "name://f/gz", false),
        ("m://p{;x,y}", "m://p;x=1;y=2", true),
        ("m://p{;x,y}", "m://p;y=2", true),
        ("m://p{;x,y}", "m://p;x", true),
        ("m://p{;x,y}", "m://p;x=", false),
        ("m://p{;x,y}", "m://p;z=1", false),
        ("search://{?q,limit}", "search://?q=red&limit=3", true),
        ("search://{?q,limit}", "search://?q=red", true),
        ("search://{?q,limit}", "search://?limit=3", true),
        ("search://{?q,limit}", "search://", true),
        ("search://{?q,limit}", "search://?q=", true),
        ("search://{?q,limit}", "search://?q", false),
        ("search://{?q,limit}", "search://?limit=3&q=red", false),
        ("search://{?q,limit}", "search://?z=1", false),
        ("search://{?q,limit}", "search://?q=a&b", false),
        ("search://{?q,limit}", "search://?q=a b", false),
        ("search://{?q,limit}", "search://?", false),
        ("search://items?all{&q}", "search://items?all&q=x", true),
        ("search://items?all{&q}", "search://items?all&r=x", false),
        // Level 4: prefixes and explosion.
        ("p://{v:3}", "p://abc", true),
        ("p://{v:3}", "p://abcd", false),
        ("p://{v:3}", "p://%C3%A9ab", true),
        ("p://{v:3}", "p://%C3%A9abc", false),
        ("p://{?v:2}", "p://?v=ab", true),
        ("p://{?v:2}", "p://?v=abc", false),
        ("p://{;v:2}", "p://;v", true),
        ("files://r{/path*}", "files://r/a/b/c", true),
        ("files://r{/path*}", "files://r", true),
        ("files://r{/path*}", "files://r/a/b?c", false),
        ("files://r{/path}", "files://r/a/b", false),
        ("files://r{/path}", "files://r/a,b", true),
        ("q://{?tags*}", "q://?tag=a&tag=b", true),
        ("q://{?tags*}", "q://?a=1&b=2", true),
        ("q://{?tags*}", "q://?a", false),
        ("q://{;tags*}", "q://;a;b=1", true),
        ("q://{;tags*}", "q://;a=", false),
        ("k://{keys*}", "k://a=1,b=2", true),
        ("k://{keys*}", "k://a=1=2", false),
        ("k://{keys}", "k://a=1", false),
        ("k://{.keys*}", "k://.a=1.b=2", true),
        // No templates at all: they match nothing.
        ("mem://{}", "mem://", false),
        ("mem://{open", "mem://{open", false),
        ("mem://close}", "mem://close}", false),
        ("mem://{a{b}}", "mem://x", false),
        ("mem://{=x}", "mem://", false),
        ("mem://{,x}", "mem://", false),
        ("mem://{!x}", "mem://", false),
        ("mem://{@x}", "mem://", false),
        ("mem://{|x}", "mem://", false),
        ("mem://{x,}", "mem://a", false),
        ("mem://{x:0}", "mem://", false),
        ("mem://{x:10000}", "mem://a", false),
        ("mem://{x:03}", "mem://a", false),
        ("mem://{x*:3}", "mem://a", false),
        ("mem://{a..b}", "mem://x", false),
        ("mem://{.a.}", "mem://.x", false),
        ("mem://{a-b}", "mem://x", false),
        ("mem://{+}", "mem://", false),
    ];

    #[test]
    fn each_operator_allows_exactly_what_its_expansions_contain() {
        for (template, uri, expected) in CASES {
            assert_eq!(
                template_matches(template, uri),
                *expected,
                "{template} against {uri}"
            );
        }
    }

    #[test]
    fn variable_names_may_have_dots_and_percent_triplets() {
        assert!(template_matches("x://{a.b}", "x://v"));
        assert!(template_matches("x://{?a.b}", "x://?a.b=v"));
        assert!(template_matches("x://{?%41}", "x://?%41=v"));
        assert!(template_matches("x://{_1}", "x://v"));
    }

    #[test]
    fn many_expressions_in_a_row_stay_cheap() {
        let template = format!("x://{}!", "{v}".repeat(64));
        let uri = format!("x://{}", "a".repeat(4000));
        assert!(!template_matches(&template, &uri));
        assert!(template_matches(&template, &format!("{uri}!")));
        let template = format!("x://{}!", "{/v*,w:9999}{?a,b,c*}".repeat(32));
        let uri = format!("x://{}", "/a=b".repeat(4000));
        assert!(!template_matches(&template, &uri));
        assert!(template_matches(&template, &format!("{uri}!")));
    }
}
