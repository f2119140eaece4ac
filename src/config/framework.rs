//! Framework presets (`framework = "rails"`): the path, method and override rules of the
//! upstream's framework, so that an operator who knows what runs behind idemgate need not
//! know which spellings it folds. Each rule below is what the framework does by default,
//! from its own code or documentation (docs/path-spellings.md has the sources); a preset
//! only ever declares an override the framework honours unconfigured, since a declared one
//! that the upstream ignores would scope one request as two operations.
//!
//! A preset fills the settings its route leaves unset; settings written on the route win,
//! and so do `[defaults]` settings that differ from their built-in default where the preset
//! comes from `[defaults]`. Without a preset, the generic defaults stay the strictest safe
//! ones (case-sensitive, `;` parameters and unlisted suffixes refused, no override
//! declared, another method case refused).

use serde::{Deserialize, Serialize};

use super::{Defaults, MethodCase, OverrideParam, PathMatch, PathParams, Route};

/// The upstream's framework.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Framework {
    /// Express 4/5 (router, path-to-regexp).
    Express,
    /// Koa with @koa/router.
    Koa,
    /// Fastify (find-my-way).
    Fastify,
    /// Flask (Werkzeug).
    Flask,
    /// FastAPI (Starlette).
    Fastapi,
    /// Django.
    Django,
    /// Ruby on Rails (Rack).
    Rails,
    /// Laravel (Symfony HttpFoundation).
    Laravel,
    /// Spring MVC 6 (Spring Boot 3).
    Spring,
    /// Jetty and other servlet containers.
    Jetty,
    /// Go's `net/http` `ServeMux` (Go 1.22 patterns).
    Go,
}

/// The settings a preset fills.
#[derive(Debug, Default)]
struct Preset {
    // `None`: the preset cannot know (the route must say, else the spelling is refused).
    case_insensitive_paths: Option<bool>,
    strict: bool,
    plus_is_space: Option<bool>,
    raw_utf8_paths: Option<bool>,
    path_params: PathParams,
    format_suffixes: &'static [&'static str],
    method_case: MethodCase,
    method_override_headers: &'static [&'static str],
    method_override_params: &'static [OverrideParam],
}

impl Framework {
    fn preset(self) -> Preset {
        use Framework::*;
        // Every framework below compares letters as its router says and reads a raw `+`
        // in a path as a plus, unless it says otherwise. Raw bytes beyond ASCII: Node
        // refuses them (400) before any router sees them, and no preset vouches for the
        // rest: such a path is refused unless the route sets `raw_utf8_paths`.
        let generic = Preset {
            case_insensitive_paths: Some(false),
            plus_is_space: Some(false),
            ..Preset::default()
        };
        match self {
            // Router `caseSensitive: false` and `strict: false` by default.
            Express => Preset {
                case_insensitive_paths: Some(true),
                ..generic
            },
            // @koa/router: `sensitive: false`. Its parameters keep a `+` from 15 on, and
            // read it as a space up to 13 (with Koa 2, long the default): the preset
            // cannot know which runs, so a raw `+` is refused unless `plus_is_space` says.
            Koa => Preset {
                case_insensitive_paths: Some(true),
                plus_is_space: None,
                ..generic
            },
            // find-my-way: `caseSensitive: true`, `ignoreTrailingSlash: false`,
            // `ignoreDuplicateSlashes: false`.
            Fastify => Preset {
                strict: true,
                ..generic
            },
            // Werkzeug upper-cases the request method.
            Flask => Preset {
                method_case: MethodCase::Fold,
                ..generic
            },
            Fastapi | Go => generic,
            // WSGIRequest upper-cases REQUEST_METHOD.
            Django => Preset {
                method_case: MethodCase::Fold,
                ..generic
            },
            // Rack::MethodOverride (in Rails' default middleware): `_method` of a POST form
            // body, else `X-HTTP-Method-Override`; `(.:format)` on every resource route.
            Rails => Preset {
                format_suffixes: &[".json"],
                method_override_headers: &["X-HTTP-Method-Override"],
                method_override_params: &[OverrideParam::Body],
                ..generic
            },
            // Symfony's Request::getMethod on a POST: `X-HTTP-Method-Override`, then
            // `_method` of the body, then of the query (Laravel enables the parameter).
            Laravel => Preset {
                method_override_headers: &["X-HTTP-Method-Override"],
                method_override_params: &[OverrideParam::Body, OverrideParam::Query],
                ..generic
            },
            // Servlet containers cut `;` parameters off each segment before routing.
            Spring | Jetty => Preset {
                path_params: PathParams::Strip,
                ..generic
            },
        }
    }
}

/// `r` with the settings it leaves unset filled from its framework's preset (its own
/// `framework`, else `[defaults]`'s, where `[defaults]` left the setting at its built-in
/// default).
pub(super) fn apply(r: &Route, d: &Defaults) -> Route {
    let (framework, from_defaults) = match (r.framework, d.framework) {
        (Some(f), _) => (f, false),
        (None, Some(f)) => (f, true),
        (None, None) => return r.clone(),
    };
    let p = framework.preset();
    let built_in = Defaults::default();
    let mut out = r.clone();
    // From `[defaults]`, a preset gives way to what `[defaults]` set itself.
    macro_rules! fill {
        ($field:ident, $value:expr) => {
            if out.$field.is_none() && (!from_defaults || d.$field == built_in.$field) {
                out.$field = Some($value);
            }
        };
    }
    // Settings a preset may not know: filled only where it does.
    macro_rules! fill_known {
        ($field:ident, $value:expr) => {
            if let Some(v) = $value {
                fill!($field, v);
            }
        };
    }
    fill_known!(case_insensitive_paths, p.case_insensitive_paths);
    fill_known!(raw_utf8_paths, p.raw_utf8_paths);
    fill!(
        path_match,
        if p.strict {
            PathMatch::Strict
        } else {
            PathMatch::Normalized
        }
    );
    fill_known!(plus_is_space, p.plus_is_space);
    fill!(path_params, p.path_params);
    fill!(
        format_suffixes,
        p.format_suffixes.iter().map(|s| s.to_string()).collect()
    );
    fill!(method_case, p.method_case);
    fill!(
        method_override_headers,
        p.method_override_headers
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
    fill!(method_override_params, p.method_override_params.to_vec());
    out
}

#[cfg(test)]
mod tests {
    use crate::config::tests::settings;
    use crate::config::MethodCase;

    #[test]
    fn a_preset_fills_what_its_route_leaves_unset() {
        let s = settings(
            r#"
            [defaults]
            framework = "django"
            [[routes]]
            path = "/koa"
            framework = "koa"
            [[routes]]
            path = "/rails"
            framework = "rails"
            format_suffixes = [".xml"]
            [[routes]]
            path = "/plain"
            "#,
        )
        .unwrap();
        let koa = s.policy_for("/koa");
        assert!(koa.path_rules.case_insensitive && !koa.path_rules.plus_is_space);
        assert_eq!(koa.method_case, MethodCase::Refuse);
        let rails = s.policy_for("/rails");
        assert_eq!(
            rails.format_suffixes,
            vec!["xml".to_string()],
            "the route's own"
        );
        assert!(rails.override_params.body && !rails.override_params.query);
        assert_eq!(rails.method_override_headers.len(), 1);
        // `[defaults]`' preset applies to every route without its own.
        assert_eq!(s.policy_for("/plain").method_case, MethodCase::Fold);
        assert_eq!(s.default_policy.method_case, MethodCase::Fold);
        // A `[defaults]` setting of its own wins over `[defaults]`' preset.
        let s =
            settings("[defaults]\nframework = \"rails\"\nformat_suffixes = [\".xml\"]").unwrap();
        assert_eq!(s.default_policy.format_suffixes, vec!["xml".to_string()]);
        let s = settings("[defaults]\nframework = \"jetty\"").unwrap();
        assert_eq!(
            s.default_policy.path_params,
            crate::config::PathParams::Strip
        );
        assert!(settings("[defaults]\nframework = \"sinatra\"").is_err());
    }
}
