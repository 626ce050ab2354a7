//! `resnet-mnist [--width N]`: an edl trainer program. `edl run job.toml` starts copies of
//! it as the job's trainers (`[trainer] entry`); all it does is build its model.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut width = resnet_mnist::DEFAULT_WIDTH;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next().map(|v| v.parse::<usize>())) {
            ("--width", Some(Ok(w))) if w > 0 => width = w,
            _ => {
                eprintln!("usage: resnet-mnist [--width CHANNELS]  (run by `edl run job.toml`)");
                return ExitCode::from(2);
            }
        }
    }
    edl_trainer::main(move |ctx| resnet_mnist::ResMnist::new(width, ctx.device()))
}
