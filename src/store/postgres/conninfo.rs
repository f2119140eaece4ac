//! The connection string's two forms (a URL, or `key=value` pairs) and the TLS parameters
//! taken out of it before tokio-postgres reads the rest.

use percent_encoding::{percent_decode_str, utf8_percent_encode, NON_ALPHANUMERIC};

use super::tls::{SSLCERT, SSLKEY, SSLMODE, SSLROOTCERT};

/// The TLS parameters of a connection string, as written there (decoded).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Params {
    pub(super) sslmode: Option<String>,
    pub(super) sslrootcert: Option<String>,
    pub(super) sslcert: Option<String>,
    pub(super) sslkey: Option<String>,
}

impl Params {
    /// Takes `key = value` when `key` is one of the TLS parameters; `Ok(false)` otherwise.
    pub(super) fn take(&mut self, key: &str, value: String) -> Result<bool, String> {
        let slot = match key {
            SSLMODE => &mut self.sslmode,
            SSLROOTCERT => &mut self.sslrootcert,
            SSLCERT => &mut self.sslcert,
            SSLKEY => &mut self.sslkey,
            _ => return Ok(false),
        };
        if slot.as_ref().is_some_and(|v| *v != value) {
            return Err(format!("{key} is given twice, with different values"));
        }
        *slot = Some(value);
        Ok(true)
    }

    pub(super) fn pairs(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            (SSLMODE, &self.sslmode),
            (SSLROOTCERT, &self.sslrootcert),
            (SSLCERT, &self.sslcert),
            (SSLKEY, &self.sslkey),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_deref().map(|v| (k, v)))
    }
}

/// Which of the two forms tokio-postgres reads a connection string in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Form {
    /// `postgres://user:password@host:port/db?k=v&k=v`.
    Url,
    /// `host=db user=app sslmode=verify-full`.
    KeyValue,
}

/// A connection string without its TLS parameters, and those parameters.
#[derive(Debug, Clone)]
pub(super) struct Split {
    pub(super) form: Form,
    pub(super) rest: String,
    pub(super) params: Params,
}

pub(super) fn url_body(s: &str) -> Option<&str> {
    s.strip_prefix("postgres://")
        .or_else(|| s.strip_prefix("postgresql://"))
}

/// Takes the TLS parameters out of `s`. A string that does not parse is handed on as it
/// is: tokio-postgres then says what is wrong with it.
pub(super) fn split(s: &str) -> Result<Split, String> {
    match url_body(s) {
        Some(body) => split_url(s, body),
        None => split_key_value(s),
    }
}

pub(super) fn split_url(s: &str, body: &str) -> Result<Split, String> {
    let mut params = Params::default();
    // As tokio-postgres reads a URL: the credentials end at the first `@`, and the query
    // starts at the first `?` after them.
    let offset = s.len() - body.len();
    let after_credentials = body.find('@').map_or(0, |i| i + 1);
    let Some(q) = body[after_credentials..].find('?') else {
        return Ok(Split {
            form: Form::Url,
            rest: s.to_string(),
            params,
        });
    };
    let q = offset + after_credentials + q;
    let mut kept: Vec<&str> = Vec::new();
    for pair in s[q + 1..].split('&') {
        let ours = match pair.split_once('=') {
            Some((k, v)) => {
                let key = percent_decode_str(k).decode_utf8_lossy();
                let value = percent_decode_str(v)
                    .decode_utf8()
                    .map_err(|_| format!("{key} is not UTF-8"))?;
                params.take(&key, value.into_owned())?
            }
            None => false,
        };
        if !ours {
            kept.push(pair);
        }
    }
    let mut rest = s[..q].to_string();
    if !kept.is_empty() {
        rest.push('?');
        rest.push_str(&kept.join("&"));
    }
    Ok(Split {
        form: Form::Url,
        rest,
        params,
    })
}

/// The `key = value` form, tokenized as tokio-postgres does (values bare or in single
/// quotes, `\` escaping the next character); the other parameters are kept as written.
pub(super) fn split_key_value(s: &str) -> Result<Split, String> {
    let mut params = Params::default();
    let mut kept: Vec<&str> = Vec::new();
    let chars: Vec<(usize, char)> = s.char_indices().collect();
    let end = s.len();
    let at = |i: usize| chars.get(i).map_or(end, |(b, _)| *b);
    let mut i = 0;
    let unchanged = || Split {
        form: Form::KeyValue,
        rest: s.to_string(),
        params: Params::default(),
    };
    loop {
        while chars.get(i).is_some_and(|(_, c)| c.is_whitespace()) {
            i += 1;
        }
        if i >= chars.len() {
            break;
        }
        let start = i;
        while chars
            .get(i)
            .is_some_and(|(_, c)| !c.is_whitespace() && *c != '=')
        {
            i += 1;
        }
        let key = &s[at(start)..at(i)];
        while chars.get(i).is_some_and(|(_, c)| c.is_whitespace()) {
            i += 1;
        }
        if key.is_empty() || chars.get(i).map(|(_, c)| *c) != Some('=') {
            return Ok(unchanged());
        }
        i += 1;
        while chars.get(i).is_some_and(|(_, c)| c.is_whitespace()) {
            i += 1;
        }
        let mut value = String::new();
        if chars.get(i).map(|(_, c)| *c) == Some('\'') {
            i += 1;
            loop {
                match chars.get(i).map(|(_, c)| *c) {
                    None => return Ok(unchanged()),
                    Some('\'') => {
                        i += 1;
                        break;
                    }
                    Some('\\') => {
                        if let Some((_, c)) = chars.get(i + 1) {
                            value.push(*c);
                        }
                        i += 2;
                    }
                    Some(c) => {
                        value.push(c);
                        i += 1;
                    }
                }
            }
        } else {
            while let Some((_, c)) = chars.get(i) {
                if c.is_whitespace() {
                    break;
                }
                if *c == '\\' {
                    if let Some((_, c)) = chars.get(i + 1) {
                        value.push(*c);
                    }
                    i += 2;
                } else {
                    value.push(*c);
                    i += 1;
                }
            }
            if value.is_empty() {
                return Ok(unchanged());
            }
        }
        if !params.take(key, value)? {
            kept.push(&s[at(start)..at(i.min(chars.len()))]);
        }
    }
    Ok(Split {
        form: Form::KeyValue,
        rest: kept.join(" "),
        params,
    })
}

/// `rest` with `params` written back, in the string's own form.
pub(super) fn join(form: Form, rest: &str, params: &Params) -> String {
    let mut out = rest.to_string();
    let mut query = form == Form::Url && url_query_started(rest);
    for (key, value) in params.pairs() {
        match form {
            Form::Url => {
                out.push(if query { '&' } else { '?' });
                query = true;
                out.push_str(key);
                out.push('=');
                out.extend(utf8_percent_encode(value, NON_ALPHANUMERIC));
            }
            Form::KeyValue => {
                if !out.is_empty() {
                    out.push(' ');
                }
                out.push_str(key);
                out.push_str("='");
                for c in value.chars() {
                    if c == '\'' || c == '\\' {
                        out.push('\\');
                    }
                    out.push(c);
                }
                out.push('\'');
            }
        }
    }
    out
}

/// Whether the URL `s` already has a query (a `?` after its credentials).
pub(super) fn url_query_started(s: &str) -> bool {
    url_body(s).is_some_and(|body| {
        let after = body.find('@').map_or(0, |i| i + 1);
        body[after..].contains('?')
    })
}
