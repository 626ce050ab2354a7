//! The `edl` binary: parses arguments, sets up logging and hands over to the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = edl::Cli::parse();
    edl::init_logging(&cli);
    match edl::run(cli) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}
