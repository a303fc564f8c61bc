pub fn _p(){}
