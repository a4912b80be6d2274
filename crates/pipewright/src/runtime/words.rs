//! Choices spelled as words (`--precision bf16`, `--schedule 1f1b`): `word_enum!` writes a
//! fieldless enum's `FromStr`, `Display` and serde from one table of its variants' names, so
//! that what a value prints as is what it parses from and what a record holds (a flag's value,
//! a run's `params.json` and a checkpoint's spec read alike, aliases included), and the error
//! for an unknown word lists the choices.

/// `a`, `a or b`, `a, b or c`: the choices an error offers.
pub fn choices(words: &[&str]) -> String {
    match words {
        [] => String::new(),
        [one] => (*one).to_string(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// `FromStr`, `Display`, `Serialize` and `Deserialize` for the fieldless enum `$ty`: each
/// variant prints (and serializes) as its first name and parses (and deserializes) from it or
/// any alias after it (`F16 => "f16" | "fp16"`); any other word fails as
/// ``unknown {what} `{word}`: use a, b or c`` (the first names, in table order).
macro_rules! word_enum {
    ($ty:ident, $what:literal, { $($variant:ident => $name:literal $(| $alias:literal)*),+ $(,)? }) => {
        impl ::std::str::FromStr for $ty {
            type Err = $crate::Error;
            fn from_str(s: &str) -> $crate::Result<Self> {
                match s {
                    $($name $(| $alias)* => Ok($ty::$variant),)+
                    _ => Err($crate::invalid!(
                        "unknown {} `{s}`: use {}",
                        $what,
                        $crate::runtime::words::choices(&[$($name),+])
                    )),
                }
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(match self {
                    $($ty::$variant => $name,)+
                })
            }
        }

        impl ::serde::Serialize for $ty {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> ::std::result::Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $ty {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> ::std::result::Result<Self, D::Error> {
                let word = <::std::borrow::Cow<'de, str> as ::serde::Deserialize>::deserialize(d)?;
                word.parse().map_err(<D::Error as ::serde::de::Error>::custom)
            }
        }
    };
}
pub(crate) use word_enum;

#[cfg(test)]
mod tests {
    use super::choices;

    #[test]
    fn choices_read_as_a_sentence() {
        assert_eq!(choices(&[]), "");
        assert_eq!(choices(&["u16"]), "u16");
        assert_eq!(choices(&["u16", "u32"]), "u16 or u32");
        assert_eq!(choices(&["f32", "bf16", "f16"]), "f32, bf16 or f16");
    }
}
