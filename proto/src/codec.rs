//! A prost codec that sizes its encode buffer once per message.
//!
//! tonic's default prost encoder writes into a buffer that grows by doubling, so a
//! message of tens of MB (a pserver push or pull) is copied several times while it is
//! encoded, and each growth faults in fresh pages. This codec reserves the message's
//! encoded length first: one allocation, one copy.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

/// Buffer settings for large messages: 64 KiB initial buffers, yield after 1 MiB.
fn settings() -> BufferSettings {
    BufferSettings::new(64 * 1024, 1024 * 1024)
}

/// A prost codec for large messages (see the module docs).
#[derive(Debug, Clone)]
pub struct SizedProstCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for SizedProstCodec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> Codec for SizedProstCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = SizedEncoder<T>;
    type Decoder = SizedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        SizedEncoder { _pd: PhantomData }
    }

    fn decoder(&mut self) -> Self::Decoder {
        SizedDecoder(ProstDecoder::new(settings()))
    }
}

/// Encodes a prost message into a buffer reserved to its exact length.
#[derive(Debug, Clone)]
pub struct SizedEncoder<T> {
    _pd: PhantomData<T>,
}

impl<T: Message> Encoder for SizedEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, buf: &mut EncodeBuf<'_>) -> Result<(), Self::Error> {
        buf.reserve(item.encoded_len());
        item.encode(buf)
            .map_err(|e| Status::internal(format!("encode: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}

/// Decodes prost messages (tonic reserves each message's length before reading it).
#[derive(Debug)]
pub struct SizedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for SizedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Self::Error> {
        self.0.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        settings()
    }
}
